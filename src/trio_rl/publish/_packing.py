"""Packing training samples into micro-batches for data-parallel trainer ranks (docs/wire.md).

Pure, synchronous functions: the publisher runs them in worker threads. The steps follow the
reference packer:

1. each sample becomes a one-sequence micro-batch (positions ``0..L-1``), truncated to
   ``seq_len`` tokens;
2. first-fit-decreasing into bins of at most ``seq_len`` tokens; a bin never mixes routed and
   non-routed samples (nor routed samples of different dtype or row shape);
3. a bin is materialised by concatenation; an optional stream appears as soon as one sample in
   the bin carries it, and the other samples are filled (ref logprobs 0.0, mm type 0, rl weight
   1.0, ce and ref-kl weight 0.0, sampling-mask count 0, trace id ``""``, branch index -1);
   routed-expert bytes are concatenated and their ``shape[0]`` summed; payload segments are
   shifted to their sample's position in the bin;
4. padded to a multiple of ``pad_to_multiple_of`` (input id 1, advantage 0.0, mask False,
   positions ``0..pad-1``, the last sequence's length extended, logprob 0.0, temperature 1.0,
   every stream 0.0, mm type 0, env name ``""``, routed-expert rows zero, mask counts 0);
5. split across ranks: per modality, the heaviest multi-sample bins are split until the count is
   a multiple of the rank count, the remainder is made up with zero-loss fillers, and bins are
   dealt out so every rank gets the same number and similar cost.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import attrs

from ..errors import InvalidArgumentError
from ..sink import TrainingSample
from ..wire import MicroBatch, MMRefs, PayloadSegment, RoutedExperts, SamplingMask
from ._errors import PackingError
from ._pacing import Pacer

__all__ = [
    "PackedRank",
    "bin_cost",
    "pack_lazily",
    "pack_samples",
    "prepare_sample",
]

PAD_TOKEN_ID = 1
# Fill for a stream that a bin materialises but a sample in it lacks.
STREAM_FILL = {"rl_weights": 1.0, "ce_weights": 0.0, "ref_kl_weights": 0.0}
_WEIGHT_STREAMS = ("rl_weights", "ce_weights", "ref_kl_weights")
_INT32 = 4


def _describe(sample: TrainingSample, index: int) -> str:
    who = f"sample {index}"
    if sample.trace_id is not None:
        who += f" (trace {sample.trace_id!r})"
    elif sample.group_id:
        who += f" (group {sample.group_id}, index {sample.sample_index})"
    return who


def _check_length(name: str, values: Any, length: int, who: str) -> None:
    if values is not None and len(values) != length:
        raise PackingError(f"{who}: {name} has {len(values)} entries for {length} tokens")


def _check_routed(routed: RoutedExperts, length: int, who: str) -> RoutedExperts:
    rows = routed.shape[0] if routed.shape else 0
    if rows != length:
        raise PackingError(f"{who}: routed_experts has {rows} rows for {length} tokens")
    return routed


def _routed_prefix(routed: RoutedExperts, keep: int) -> RoutedExperts:
    rows = routed.shape[0]
    if keep == rows:
        return routed
    row_bytes = len(routed.data) // rows if rows else 0
    return RoutedExperts(
        data=bytes(memoryview(routed.data)[: keep * row_bytes]),
        shape=[keep, *routed.shape[1:]],
        dtype=routed.dtype,
    )


def _mask_prefix(mask: SamplingMask, length: int, keep: int, who: str) -> SamplingMask:
    if len(mask.counts) != _INT32 * length:
        raise PackingError(
            f"{who}: sampling_mask has {len(mask.counts) // _INT32} counts for {length} tokens"
        )
    if keep == length:
        return mask
    counts = memoryview(mask.counts).cast("i")
    kept_ids = sum(counts[:keep])
    return SamplingMask(
        ids=bytes(memoryview(mask.ids)[: _INT32 * kept_ids]),
        counts=bytes(memoryview(mask.counts)[: _INT32 * keep]),
    )


def _segments_prefix(segments: list[PayloadSegment], keep: int) -> list[PayloadSegment]:
    out = []
    for s in segments:
        if s.pos >= keep:
            continue
        out.append(attrs.evolve(s, rows=min(s.rows, keep - s.pos), shape=list(s.shape)))
    return out


def _validate(sample: TrainingSample, index: int) -> int:
    """Check ``sample`` can be packed (the errors of `prepare_sample`); return its length."""
    who = _describe(sample, index)
    length = len(sample.token_ids)
    if length == 0:
        raise PackingError(f"{who}: has no tokens")
    for name in (
        "mask",
        "logprobs",
        "temperatures",
        "advantages",
        "ref_logprobs",
        "mm_token_type_ids",
        *_WEIGHT_STREAMS,
    ):
        _check_length(name, getattr(sample, name), length, who)
    if sample.advantages is None:
        rl = sample.rl_weights
        if any(m and (rl is None or rl[i] != 0) for i, m in enumerate(sample.mask)):
            raise PackingError(f"{who}: has trainable rl tokens but no advantages")
    if sample.routed_experts is not None:
        _check_routed(sample.routed_experts, length, who)
    mask = sample.sampling_mask
    if mask is not None and len(mask.counts) != _INT32 * length:
        raise PackingError(
            f"{who}: sampling_mask has {len(mask.counts) // _INT32} counts for {length} tokens"
        )
    return length


def prepare_sample(sample: TrainingSample, seq_len: int, *, index: int = 0) -> MicroBatch:
    """One sample as a one-sequence micro-batch, truncated to ``seq_len`` tokens.

    Raises :class:`PackingError` when the sample's per-token streams disagree in length or it
    has trainable rl tokens but no advantages.
    """
    length = _validate(sample, index)
    who = _describe(sample, index)
    advantages = sample.advantages
    if advantages is None:
        advantages = [0.0] * length
    keep = min(length, seq_len)

    def cut(values: list[Any] | None) -> list[Any] | None:
        return None if values is None else values[:keep]

    routed = sample.routed_experts
    if routed is not None:
        routed = _routed_prefix(routed, keep)
    mask = sample.sampling_mask
    if mask is not None:
        mask = _mask_prefix(mask, length, keep, who)
    return MicroBatch(
        input_ids=sample.token_ids[:keep],
        loss_mask=sample.mask[:keep],
        advantages=advantages[:keep],
        inference_logprobs=sample.logprobs[:keep],
        position_ids=list(range(keep)),
        sequence_lengths=[keep],
        temperatures=sample.temperatures[:keep],
        env_names=[sample.env_name] * keep,
        seq_lens=[keep],
        ref_logprobs=cut(sample.ref_logprobs),
        routed_experts=routed,
        mm_refs=None if sample.mm_refs is None else MMRefs(list(sample.mm_refs.images)),
        mm_token_type_ids=cut(sample.mm_token_type_ids),
        rl_weights=cut(sample.rl_weights),
        ce_weights=cut(sample.ce_weights),
        ref_kl_weights=cut(sample.ref_kl_weights),
        sampling_mask=mask,
        trace_ids=None if sample.trace_id is None else [sample.trace_id],
        branch_indices=None if sample.branch_index is None else [sample.branch_index],
        payload=None if sample.payload is None else _segments_prefix(sample.payload, keep),
    )


@attrs.frozen
class _Item:
    """A validated sample, as the packing plan sees it (no token data copied)."""

    index: int
    num_tokens: int  # after truncation to seq_len
    key: tuple[Any, ...]


def _sample_modality(sample: TrainingSample) -> tuple[Any, ...]:
    """`_modality` of the sample's micro-batch, without building it."""
    routed = sample.routed_experts
    if routed is None:
        return ()
    return ("routed", routed.dtype, tuple(routed.shape[1:]))


def _first_fit_decreasing(items: list[_Item], seq_len: int, pace: Pacer) -> list[list[_Item]]:
    bins: list[list[_Item]] = []
    room: list[int] = []
    keys: list[tuple[Any, ...]] = []
    # sorted() is stable: equal lengths keep their arrival order.
    for item in sorted(items, key=lambda m: -m.num_tokens):
        pace()
        for b, free in enumerate(room):
            if free >= item.num_tokens and keys[b] == item.key:
                bins[b].append(item)
                room[b] -= item.num_tokens
                break
        else:
            bins.append([item])
            room.append(seq_len - item.num_tokens)
            keys.append(item.key)
    return bins


def _optional_stream(parts: Sequence[MicroBatch], name: str, fill: Any) -> list[Any] | None:
    if all(getattr(p, name) is None for p in parts):
        return None
    out: list[Any] = []
    for p in parts:
        values = getattr(p, name)
        out.extend(values if values is not None else [fill] * p.num_tokens)
    return out


def _per_sequence(parts: Sequence[MicroBatch], name: str, fill: Any) -> list[Any] | None:
    if all(getattr(p, name) is None for p in parts):
        return None
    out: list[Any] = []
    for p in parts:
        values = getattr(p, name)
        out.extend(values if values is not None else [fill] * len(p.sequence_lengths))
    return out


def _materialise(parts: list[MicroBatch]) -> MicroBatch:
    def cat(name: str) -> list[Any]:
        out: list[Any] = []
        for p in parts:
            out.extend(getattr(p, name))
        return out

    routed = None
    if parts[0].routed_experts is not None:
        pieces = [p.routed_experts for p in parts if p.routed_experts is not None]
        routed = RoutedExperts(
            data=b"".join(r.data for r in pieces),
            shape=[sum(r.shape[0] for r in pieces), *pieces[0].shape[1:]],
            dtype=pieces[0].dtype,
        )
    mm_refs = None
    if any(p.mm_refs is not None for p in parts):
        mm_refs = MMRefs([image for p in parts if p.mm_refs for image in p.mm_refs.images])
    sampling_mask = None
    if any(p.sampling_mask is not None for p in parts):
        ids, counts = bytearray(), bytearray()
        for p in parts:
            if p.sampling_mask is None:
                counts += bytes(_INT32 * p.num_tokens)
            else:
                ids += p.sampling_mask.ids
                counts += p.sampling_mask.counts
        sampling_mask = SamplingMask(ids=bytes(ids), counts=bytes(counts))
    payload = None
    if any(p.payload is not None for p in parts):
        payload = []
        start = 0
        for p in parts:
            for s in p.payload or ():
                payload.append(attrs.evolve(s, pos=s.pos + start))
            start += p.num_tokens
    return MicroBatch(
        input_ids=cat("input_ids"),
        loss_mask=cat("loss_mask"),
        advantages=cat("advantages"),
        inference_logprobs=cat("inference_logprobs"),
        position_ids=cat("position_ids"),
        sequence_lengths=cat("sequence_lengths"),
        temperatures=cat("temperatures"),
        env_names=cat("env_names"),
        seq_lens=cat("seq_lens"),
        ref_logprobs=_optional_stream(parts, "ref_logprobs", 0.0),
        routed_experts=routed,
        mm_refs=mm_refs,
        mm_token_type_ids=_optional_stream(parts, "mm_token_type_ids", 0),
        rl_weights=_optional_stream(parts, "rl_weights", STREAM_FILL["rl_weights"]),
        ce_weights=_optional_stream(parts, "ce_weights", STREAM_FILL["ce_weights"]),
        ref_kl_weights=_optional_stream(parts, "ref_kl_weights", STREAM_FILL["ref_kl_weights"]),
        sampling_mask=sampling_mask,
        trace_ids=_per_sequence(parts, "trace_ids", ""),
        branch_indices=_per_sequence(parts, "branch_indices", -1),
        payload=payload,
    )


def _pad(mb: MicroBatch, multiple: int) -> MicroBatch:
    pad = -mb.num_tokens % multiple
    if pad == 0:
        return mb
    mb.input_ids.extend([PAD_TOKEN_ID] * pad)
    mb.loss_mask.extend([False] * pad)
    mb.advantages.extend([0.0] * pad)
    mb.inference_logprobs.extend([0.0] * pad)
    mb.position_ids.extend(range(pad))
    mb.sequence_lengths[-1] += pad
    mb.seq_lens[-1] += pad
    mb.temperatures.extend([1.0] * pad)
    mb.env_names.extend([""] * pad)
    for name in ("ref_logprobs", *_WEIGHT_STREAMS):
        values = getattr(mb, name)
        if values is not None:
            values.extend([0.0] * pad)
    if mb.mm_token_type_ids is not None:
        mb.mm_token_type_ids.extend([0] * pad)
    routed = mb.routed_experts
    if routed is not None:
        row_bytes = len(routed.data) // routed.shape[0] if routed.shape[0] else 0
        routed.data = routed.data + bytes(row_bytes * pad)
        routed.shape[0] += pad
    if mb.sampling_mask is not None:
        mb.sampling_mask.counts = mb.sampling_mask.counts + bytes(_INT32 * pad)
    return mb


def bin_cost(mb: MicroBatch, seq_len: int) -> float:
    """Relative trainer cost of a micro-batch: linear in tokens plus attention's square term."""
    return mb.num_tokens + sum(length * length for length in mb.sequence_lengths) / seq_len


def _zero_loss(mb: MicroBatch) -> MicroBatch:
    """A filler that trains nothing: a copy of ``mb`` without advantages, mask or weights."""
    filler = copy.deepcopy(mb)
    filler.advantages = [0.0] * mb.num_tokens
    filler.loss_mask = [False] * mb.num_tokens
    filler.rl_weights = filler.ce_weights = filler.ref_kl_weights = None
    return filler


def _split_heaviest(bins: list[list[_Item]], num_ranks: int) -> None:
    """Split multi-sample bins, heaviest first, until the count is a multiple of the ranks."""
    while len(bins) % num_ranks:
        multi = [b for b in bins if len(b) > 1]
        if not multi:
            return
        heaviest = max(multi, key=lambda b: sum(p.num_tokens for p in b))
        bins.remove(heaviest)
        # Deal the samples (longest first) into two halves of similar size.
        halves: tuple[list[_Item], list[_Item]] = ([], [])
        for part in heaviest:  # already longest first
            lighter = min(halves, key=lambda h: sum(p.num_tokens for p in h))
            lighter.append(part)
        bins.extend(halves)


@attrs.frozen
class _Bin:
    """One planned micro-batch: which samples, in order, and whether it is a zero-loss filler
    (a copy of the bin without advantages, mask or weights)."""

    items: tuple[_Item, ...]
    pad: int
    filler: bool = False

    def cost(self, seq_len: int) -> float:
        """`bin_cost` of the micro-batch this bin materialises to (same float)."""
        lengths = [item.num_tokens for item in self.items]
        lengths[-1] += self.pad
        return sum(lengths) + sum(length * length for length in lengths) / seq_len


def _no_pace() -> None:
    """No yield point (a micro-batch read by index: the reader paces itself, if at all)."""


class PackedRank(Sequence[MicroBatch]):
    """One rank's micro-batches, built from the samples when an item is read.

    A packing plan holds no token data: each micro-batch's lists are built when it is
    indexed or iterated, and belong to the caller from then on (a fresh object on every
    read, equal to `pack_samples`' micro-batch at the same place). Streaming a rank through
    `trio_rl.wire.encode_into` therefore keeps one micro-batch alive at a time, instead of the
    step's whole token data as young Python lists, which every cyclic-GC collection of the
    young generations would walk while the step is finalized (docs/bench/publish.md).
    """

    __slots__ = ("_bins", "_pad_to", "_samples", "_seq_len")

    def __init__(
        self, samples: Sequence[TrainingSample], bins: list[_Bin], seq_len: int, pad_to: int
    ) -> None:
        self._samples = samples
        self._bins = bins
        self._seq_len = seq_len
        self._pad_to = pad_to

    def __len__(self) -> int:
        return len(self._bins)

    @overload
    def __getitem__(self, index: int) -> MicroBatch: ...
    @overload
    def __getitem__(self, index: slice) -> list[MicroBatch]: ...
    def __getitem__(self, index: int | slice) -> MicroBatch | list[MicroBatch]:
        if isinstance(index, slice):
            return [self._build(b) for b in self._bins[index]]
        return self._build(self._bins[index])

    def __iter__(self) -> Iterator[MicroBatch]:
        # Read by an encoder in a worker: between micro-batches the event loop gets the GIL.
        pace = Pacer()
        for b in self._bins:
            pace()
            mb = self._build(b, pace)
            pace()
            yield mb

    def costs(self) -> list[float]:
        """`bin_cost` of each micro-batch, without building any."""
        return [b.cost(self._seq_len) for b in self._bins]

    def _build(self, b: _Bin, pace: Callable[[], None] = _no_pace) -> MicroBatch:
        samples, seq_len = self._samples, self._seq_len
        # Yield points between the samples of a micro-batch too (and `__iter__` yields again
        # once it is built): building one (1.2 ms of CPU for 16k tokens) plus encoding the
        # previous one (0.8 ms) kept the GIL from the loop for 2-3 ms at a time; now one
        # sample's slices, the concatenation (0.4 ms) or one encoding at a time.
        parts = []
        for i in b.items:
            parts.append(prepare_sample(samples[i.index], seq_len, index=i.index))
            pace()
        mb = _pad(_materialise(parts), self._pad_to)
        return _zero_loss(mb) if b.filler else mb


def pack_lazily(
    samples: Sequence[TrainingSample],
    *,
    seq_len: int,
    num_ranks: int = 1,
    pad_to_multiple_of: int = 1,
) -> list[PackedRank]:
    """`pack_samples`' plan: the same micro-batches in the same places, built on reading.

    Every sample is validated now (the same :class:`PackingError` and ``ValueError`` as
    `pack_samples`); no token data is copied until a `PackedRank` item is read. ``samples``
    must not change until the ranks have been read. Pure and synchronous (a worker thread).
    """
    if seq_len < 1 or num_ranks < 1 or pad_to_multiple_of < 1:
        raise InvalidArgumentError(
            "seq_len, num_ranks and pad_to_multiple_of must all be at least 1, got "
            f"{seq_len}, {num_ranks} and {pad_to_multiple_of}"
        )
    if seq_len % pad_to_multiple_of:
        raise InvalidArgumentError(
            f"seq_len ({seq_len}) must be a multiple of pad_to_multiple_of ({pad_to_multiple_of})"
            " so that padded micro-batches still fit"
        )
    # The plan is pure Python over every sample and every open bin (6 ms of a worker's CPU for
    # 1,024 samples, in which the loop could not run): it yields the GIL between samples.
    pace = Pacer()
    items = []
    for i, s in enumerate(samples):
        pace()
        items.append(_Item(i, min(_validate(s, i), seq_len), _sample_modality(s)))
    by_modality: dict[tuple[Any, ...], list[list[_Item]]] = {}
    for b in _first_fit_decreasing(items, seq_len, pace):
        by_modality.setdefault(b[0].key, []).append(b)
    ranks: list[list[_Bin]] = [[] for _ in range(num_ranks)]
    costs = [0.0] * num_ranks
    for group in by_modality.values():
        _split_heaviest(group, num_ranks)
        planned = [
            _Bin(tuple(b), -sum(i.num_tokens for i in b) % pad_to_multiple_of) for b in group
        ]
        if len(planned) % num_ranks:
            filler = attrs.evolve(planned[0], filler=True)
            planned.extend([filler] * (-len(planned) % num_ranks))
        per_rank = len(planned) // num_ranks
        taken = [0] * num_ranks
        # Greedy balance: the costliest batch goes to the cheapest rank with room left.
        for planned_bin in sorted(planned, key=lambda m: -m.cost(seq_len)):
            rank = min((r for r in range(num_ranks) if taken[r] < per_rank), key=lambda r: costs[r])
            ranks[rank].append(planned_bin)
            taken[rank] += 1
            costs[rank] += planned_bin.cost(seq_len)
    return [PackedRank(samples, bins, seq_len, pad_to_multiple_of) for bins in ranks]


def pack_samples(
    samples: Sequence[TrainingSample],
    *,
    seq_len: int,
    num_ranks: int = 1,
    pad_to_multiple_of: int = 1,
) -> list[list[MicroBatch]]:
    """Pack ``samples`` into micro-batches for ``num_ranks`` data-parallel ranks.

    Returns one list per rank, all of the same length. No micro-batch holds more than
    ``seq_len`` tokens (which must be a multiple of ``pad_to_multiple_of``); every token of every
    (truncated) sample lands in exactly one micro-batch; fillers carry no loss. Pure and
    synchronous (CPU work for a worker thread). Raises :class:`PackingError` for a sample that
    cannot be packed and ``ValueError`` for bad arguments. `pack_lazily` gives the same
    micro-batches built one at a time, as they are read.
    """
    return [
        list(rank)
        for rank in pack_lazily(
            samples, seq_len=seq_len, num_ranks=num_ranks, pad_to_multiple_of=pad_to_multiple_of
        )
    ]
