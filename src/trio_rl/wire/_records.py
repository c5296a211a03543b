"""The records of the wire format (docs/wire.md). Field order here *is* the wire order."""

from __future__ import annotations

import attrs

from ..payloads import PayloadSegment

__all__ = [
    "MMImageRef",
    "MMRefs",
    "MicroBatch",
    "RoutedExperts",
    "SamplingMask",
]


@attrs.define(slots=True)
class RoutedExperts:
    """Router replay: raw little-endian bytes of a C-contiguous ``[seq, layers, topk]`` array."""

    data: bytes
    shape: list[int]
    dtype: str


@attrs.define(slots=True)
class MMImageRef:
    """One image of a multimodal sample, by reference (the trainer fetches and encodes it).

    ``url`` names the image; ``offset`` and ``length`` are its placeholder tokens' range in the
    sample's token sequence (first position, count).
    """

    url: str
    offset: int
    length: int


@attrs.define(slots=True)
class MMRefs:
    """The image references of a sample or a micro-batch (wire field ``mm_refs``).

    Packing concatenates those of the samples it packs, in packing order and as they are: no
    offset is shifted and no image is cut on truncation (see docs/wire.md).
    """

    images: list[MMImageRef]


@attrs.define(slots=True)
class SamplingMask:
    """Top-p/top-k replay: flat int32 token ids and an int32 count per position (0 = none)."""

    ids: bytes
    counts: bytes


@attrs.define(slots=True)
class MicroBatch:
    """One packed micro-batch: its 20 fields, in wire order (docs/wire.md, "Layout")."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_refs: MMRefs | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    sampling_mask: SamplingMask | None = None
    trace_ids: list[str] | None = None
    branch_indices: list[int] | None = None
    payload: list[PayloadSegment] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
