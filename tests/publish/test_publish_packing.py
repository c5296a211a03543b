"""Packing: first-fit-decreasing bins, padding, per-rank split (SPEC 4.2)."""

from __future__ import annotations

import gc
import io
import re
import types
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import scaled
from trio_rl.errors import InvalidArgumentError
from trio_rl.publish import PackingError, pack_lazily, pack_samples
from trio_rl.publish._packing import bin_cost, prepare_sample
from trio_rl.sink import TrainingSample
from trio_rl.wire import (
    MicroBatch,
    PayloadSegment,
    RoutedExperts,
    SamplingMask,
    decode,
    encode,
    encode_into,
)

ROW = 2  # routed-expert bytes per token in these tests ([L, 2, 1] uint8)


@st.composite
def samples(draw: st.DrawFn, index: int) -> TrainingSample:
    length = draw(st.integers(1, 24))
    # Tokens are unique across samples, so each token's destination can be traced.
    tokens = [index * 1000 + 2 + j for j in range(length)]
    bits = draw(st.integers(0, 2**length - 1))
    mask = [bool(bits >> j & 1) for j in range(length)]
    mask[draw(st.integers(0, min(length, 4) - 1))] = True  # trains something even when cut
    # One drawn value per stream, varied per token: cheap examples, distinct values.
    floats = st.builds(lambda x: [x + j / 8 for j in range(length)], st.floats(-5, 5))
    optional = st.none() | floats
    routed = draw(st.booleans())
    counts = [(t * 7) % 3 for t in tokens]
    return TrainingSample(
        token_ids=tokens,
        mask=mask,
        logprobs=draw(floats),
        temperatures=[draw(st.sampled_from([0.7, 1.0]))] * length,
        env_name=draw(st.sampled_from(["math", "code"])),
        advantages=draw(floats),
        ref_logprobs=draw(optional),
        routed_experts=(
            RoutedExperts(
                bytes((t + k) % 256 for t in tokens for k in range(ROW)), [length, 2, 1], "uint8"
            )
            if routed
            else None
        ),
        mm_token_type_ids=draw(st.none() | st.just([1] * length)),
        rl_weights=draw(optional),
        ce_weights=draw(optional),
        ref_kl_weights=draw(optional),
        sampling_mask=draw(
            st.none()
            | st.just(
                SamplingMask(
                    ids=b"".join(
                        t.to_bytes(4, "little")
                        for t, c in zip(tokens, counts, strict=True)
                        for _ in range(c)
                    ),
                    counts=b"".join(c.to_bytes(4, "little") for c in counts),
                )
            )
        ),
        trace_id=draw(st.none() | st.just(f"trace-{index}")),
        branch_index=draw(st.none() | st.just(index)),
        payload=draw(
            st.none()
            | st.just(
                [
                    PayloadSegment(
                        "routed_experts",
                        f"v0/{index}.bin",
                        64,
                        length // 2,
                        length - length // 2,
                        "uint8",
                        [2, 1],
                    )
                ]
            )
        ),
        sample_index=index,
    )


@st.composite
def packing_cases(draw: st.DrawFn) -> tuple[list[TrainingSample], int, int, int]:
    pad = draw(st.sampled_from([1, 2, 4]))
    seq_len = pad * draw(st.integers(4, 16))
    n = draw(st.integers(0, 10))
    return [draw(samples(i)) for i in range(n)], seq_len, draw(st.integers(1, 4)), pad


def _sequences(mb: MicroBatch) -> list[tuple[int, int]]:
    """(start, end) of each sequence in ``mb``."""
    out, start = [], 0
    for length in mb.sequence_lengths:
        out.append((start, start + length))
        start += length
    return out


@given(packing_cases())
def test_packing_invariants(case: tuple[list[TrainingSample], int, int, int]) -> None:
    items, seq_len, num_ranks, pad = case
    ranks = pack_samples(items, seq_len=seq_len, num_ranks=num_ranks, pad_to_multiple_of=pad)
    assert len(ranks) == num_ranks
    assert len({len(r) for r in ranks}) == 1, "every rank gets the same number of micro-batches"
    for rank in ranks:  # what is packed can be shipped
        assert encode(decode(encode(rank))) == encode(rank)
    by_first_token = {s.token_ids[0]: s for s in items}
    seen: Counter[int] = Counter()
    for mb in (mb for rank in ranks for mb in rank):
        t = mb.num_tokens
        assert 0 < t <= seq_len
        assert t % pad == 0
        assert sum(mb.sequence_lengths) == sum(mb.seq_lens) == t
        for name in ("loss_mask", "advantages", "inference_logprobs", "position_ids",
                     "temperatures", "env_names", "ref_logprobs", "mm_token_type_ids",
                     "rl_weights", "ce_weights", "ref_kl_weights"):  # fmt: skip
            values = getattr(mb, name)
            assert values is None or len(values) == t, name
        if mb.routed_experts is not None:
            assert mb.routed_experts.shape == [t, 2, 1]
            assert len(mb.routed_experts.data) == t * ROW
        if mb.sampling_mask is not None:
            assert len(mb.sampling_mask.counts) == 4 * t
        if not any(mb.loss_mask):  # a zero-loss filler
            assert set(mb.advantages) <= {0.0}
            assert mb.rl_weights is mb.ce_weights is mb.ref_kl_weights is None
            continue
        seqs = _sequences(mb)
        for k, (start, end) in enumerate(seqs):
            sample = by_first_token[mb.input_ids[start]]
            keep = min(len(sample.token_ids), seq_len)
            real_end = start + keep
            assert mb.input_ids[start:real_end] == sample.token_ids[:keep]
            assert mb.position_ids[start:real_end] == list(range(keep))
            assert mb.loss_mask[start:real_end] == sample.mask[:keep]
            assert mb.advantages[start:real_end] == sample.advantages[:keep]  # type: ignore[index]
            assert mb.env_names[start:real_end] == [sample.env_name] * keep
            # Never mix routed and non-routed samples.
            assert (mb.routed_experts is None) == (sample.routed_experts is None)
            if mb.routed_experts is not None:
                assert sample.routed_experts is not None
                assert (
                    mb.routed_experts.data[start * ROW : real_end * ROW]
                    == sample.routed_experts.data[: keep * ROW]
                )
            fills = {
                "ref_logprobs": 0.0,
                "rl_weights": 1.0,
                "ce_weights": 0.0,
                "ref_kl_weights": 0.0,
            }
            for name, fill in fills.items():
                own, packed = getattr(sample, name), getattr(mb, name)
                if packed is not None:
                    assert packed[start:real_end] == (
                        own[:keep] if own is not None else [fill] * keep
                    )
                else:
                    assert own is None
            if mb.trace_ids is not None:
                assert mb.trace_ids[k] == (sample.trace_id or "")
            if sample.payload is not None:
                assert mb.payload is not None
                for seg in sample.payload:
                    if seg.pos < keep:
                        assert any(
                            s.file == seg.file and s.pos == start + seg.pos for s in mb.payload
                        )
            if end > real_end:  # padding: only ever after the last sequence
                assert k == len(seqs) - 1
                tail = slice(real_end, end)
                assert mb.input_ids[tail] == [1] * (end - real_end)
                assert mb.position_ids[tail] == list(range(end - real_end))
                assert not any(mb.loss_mask[tail])
                assert set(mb.advantages[tail]) == set(mb.inference_logprobs[tail]) == {0.0}
                assert set(mb.temperatures[tail]) == {1.0}
                assert set(mb.env_names[tail]) == {""}
            seen[sample.token_ids[0]] += 1
    # Every sample (so every token) lands exactly once outside fillers.
    assert seen == Counter(list(by_first_token))


def _sample(length: int, **kw: Any) -> TrainingSample:
    fields: dict[str, Any] = {
        "token_ids": list(range(10, 10 + length)),
        "mask": [True] * length,
        "logprobs": [-0.5] * length,
        "temperatures": [1.0] * length,
        "env_name": "env",
        "advantages": [1.0] * length,
    }
    fields.update(kw)
    return TrainingSample(**fields)


@given(st.lists(st.integers(1, 16), max_size=30), st.integers(1, 4))
def test_ranks_are_balanced(lengths: list[int], num_ranks: int) -> None:
    ranks = pack_samples([_sample(n) for n in lengths], seq_len=16, num_ranks=num_ranks)
    costs = [sum(bin_cost(mb, 16) for mb in rank) for rank in ranks]
    heaviest = max((bin_cost(mb, 16) for rank in ranks for mb in rank), default=0.0)
    # Costliest first to the cheapest rank with room: no rank is more than one bin ahead.
    assert max(costs) - min(costs) <= heaviest


def test_first_fit_decreasing_and_truncation() -> None:
    items = [_sample(3), _sample(6), _sample(5), _sample(12), _sample(2)]
    (rank,) = pack_samples(items, seq_len=8)
    # Sorted 12 (cut to 8), 6, 5, 3, 2: bins [8], [6, 2], [5, 3].
    assert [mb.sequence_lengths for mb in rank] == [[8], [6, 2], [5, 3]]
    assert rank[0].input_ids == list(range(10, 18))


def test_routed_and_non_routed_never_share_a_bin() -> None:
    routed = RoutedExperts(bytes(4), [2, 2, 1], "uint8")
    items = [_sample(2), _sample(2, routed_experts=routed), _sample(2)]
    (rank,) = pack_samples(items, seq_len=8)
    assert sorted(mb.sequence_lengths for mb in rank) == [[2], [2, 2]]
    (routed_mb,) = [mb for mb in rank if mb.routed_experts is not None]
    assert routed_mb.sequence_lengths == [2]


def test_fillers_make_rank_counts_equal_and_train_nothing() -> None:
    ranks = pack_samples([_sample(8), _sample(8), _sample(8)], seq_len=8, num_ranks=2)
    assert [len(r) for r in ranks] == [2, 2]
    fillers = [mb for r in ranks for mb in r if not any(mb.loss_mask)]
    assert len(fillers) == 1
    assert set(fillers[0].advantages) == {0.0}


def test_heaviest_multi_sample_bin_is_split_before_adding_fillers() -> None:
    ranks = pack_samples([_sample(4), _sample(4)], seq_len=8, num_ranks=2)
    assert [[mb.sequence_lengths for mb in r] for r in ranks] == [[[4]], [[4]]]


def test_padding_extends_the_last_sequence() -> None:
    (rank,) = pack_samples([_sample(3, ref_logprobs=[-1.0] * 3)], seq_len=8, pad_to_multiple_of=4)
    (mb,) = rank
    assert mb.input_ids == [10, 11, 12, 1]
    assert mb.sequence_lengths == mb.seq_lens == [4]
    assert mb.position_ids == [0, 1, 2, 0]
    assert mb.ref_logprobs == [-1.0, -1.0, -1.0, 0.0]
    assert mb.env_names == ["env"] * 3 + [""]


def test_sampling_mask_truncation_keeps_whole_positions() -> None:
    counts = [1, 2, 0, 3]
    mask = SamplingMask(
        ids=b"".join(i.to_bytes(4, "little") for i in range(6)),
        counts=b"".join(c.to_bytes(4, "little") for c in counts),
    )
    mb = prepare_sample(_sample(4, sampling_mask=mask), seq_len=2)
    assert mb.sampling_mask is not None
    assert mb.sampling_mask.counts == mask.counts[:8]
    assert mb.sampling_mask.ids == mask.ids[:12]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"mask": [True]}, "mask has 1 entries for 3 tokens"),
        ({"advantages": None}, "trainable rl tokens but no advantages"),
        ({"routed_experts": RoutedExperts(b"", [2, 1, 1], "uint8")}, "2 rows for 3 tokens"),
    ],
)
def test_unpackable_samples_are_named(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(PackingError, match=message) as info:
        pack_samples([_sample(3), _sample(3, trace_id="t-7", **kw)], seq_len=8)
    assert "sample 1 (trace 't-7')" in str(info.value)


def test_no_advantages_without_rl_tokens_gives_zeros() -> None:
    mb = prepare_sample(_sample(2, advantages=None, rl_weights=[0.0, 0.0]), seq_len=8)
    assert mb.advantages == [0.0, 0.0]


def test_seq_len_must_be_a_multiple_of_the_padding() -> None:
    with pytest.raises(ValueError, match="multiple"):
        pack_samples([], seq_len=10, pad_to_multiple_of=4)


def _lists_reachable(root: object, skip: object) -> list[list[Any]]:
    """Every list reachable from ``root`` through the GC referents of instances (not of
    classes, modules or functions, which reach the whole interpreter), not entering ``skip``."""
    seen, stack, found = {id(skip)}, [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType | types.FunctionType):
            continue
        seen.add(id(obj))
        if isinstance(obj, list):
            found.append(obj)
        stack.extend(gc.get_referents(obj))
    return found


@settings(max_examples=scaled(40), deadline=None)
@given(packing_cases())
def test_lazy_ranks_build_the_eager_micro_batches_on_read(
    case: tuple[list[TrainingSample], int, int, int],
) -> None:
    items, seq_len, num_ranks, pad = case
    eager = pack_samples(items, seq_len=seq_len, num_ranks=num_ranks, pad_to_multiple_of=pad)
    lazy = pack_lazily(items, seq_len=seq_len, num_ranks=num_ranks, pad_to_multiple_of=pad)
    assert len(lazy) == num_ranks
    for rank, ranked in zip(lazy, eager, strict=True):
        assert len(rank) == len(ranked)
        assert rank.costs() == [bin_cost(mb, seq_len) for mb in ranked]
        out = io.BytesIO()
        assert encode_into(rank, out) == len(encode(ranked))
        assert out.getvalue() == encode(ranked)  # streamed read: the same bytes
        assert [encode([rank[i]]) for i in range(len(rank))] == [encode([m]) for m in ranked]
        assert encode(rank[1:]) == encode(ranked[1:])
        if len(rank):
            assert rank[0] is not rank[0], "each read builds a fresh micro-batch"
        # The plan holds no per-token list: only the caller's samples do.
        longest = max((len(x) for x in _lists_reachable(rank, items)), default=0)
        assert longest <= max(len(items), num_ranks, 1)


def test_lazy_packing_validates_every_sample_up_front() -> None:
    with pytest.raises(PackingError, match="sample 1: logprobs has 1 entries for 2 tokens"):
        pack_lazily([_sample(2), _sample(2, logprobs=[0.0])], seq_len=8)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"seq_len": 0},
            "seq_len, num_ranks and pad_to_multiple_of must all be at least 1, got 0, 1 and 1",
        ),
        (
            {"seq_len": 10, "pad_to_multiple_of": 4},
            "seq_len (10) must be a multiple of pad_to_multiple_of (4)",
        ),
    ],
)
def test_a_bad_packing_argument_is_an_invalid_argument_naming_it(
    kw: dict[str, int], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        pack_lazily([], **kw)
