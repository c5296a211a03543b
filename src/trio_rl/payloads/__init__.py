"""By-handle payloads: per-token side arrays in files, referenced by :class:`PayloadSegment`.

The ground floor of the package: rollout writes payload files, samples and micro-batches carry
segments, the trainer reads and deletes them. Imports nothing of trio-rl but its errors.
"""

from ._segment import PayloadSegment as PayloadSegment
from ._segment import clip_segments as clip_segments
from ._segment import row_bytes as row_bytes
from ._segment import segment_files as segment_files
from ._segment import shift_segments as shift_segments
from ._store import FIELD_FILLS as FIELD_FILLS
from ._store import FIELDS as FIELDS
from ._store import FieldSpec as FieldSpec
from ._store import PayloadStore as PayloadStore
from ._store import delete_files as delete_files
from ._store import field_window as field_window
from ._store import read_field as read_field
