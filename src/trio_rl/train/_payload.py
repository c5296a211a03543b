"""By-handle payloads moved to :mod:`trio_rl.payloads`; these names stay importable here."""

from ..payloads import FIELD_FILLS as FIELD_FILLS
from ..payloads import PayloadStore as PayloadStore
from ..payloads import clip_segments as clip_segments
from ..payloads import segment_files as segment_files
from ..payloads import shift_segments as shift_segments

__all__ = ["FIELD_FILLS", "PayloadStore", "clip_segments", "segment_files", "shift_segments"]
