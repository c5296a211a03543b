"""The wire format: micro-batch records and their byte-exact MessagePack encoding.

Imports nothing of ours: the wire format knows nothing of scheduling.
"""

from ..payloads import PayloadSegment as PayloadSegment
from ._decode import decode as decode
from ._encode import encode as encode
from ._encode import encode_into as encode_into
from ._errors import WireEncodeError as WireEncodeError
from ._errors import WireFormatError as WireFormatError
from ._records import MicroBatch as MicroBatch
from ._records import MMImageRef as MMImageRef
from ._records import MMRefs as MMRefs
from ._records import RoutedExperts as RoutedExperts
from ._records import SamplingMask as SamplingMask
