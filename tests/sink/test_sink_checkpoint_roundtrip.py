"""One validator for the checkpoint writer and reader, over generated sink states.

Whatever `encode_checkpoint` accepts, `decode_checkpoint` reads back equal; whatever it refuses
(a `CheckpointError` before a byte is returned), the reader refuses too when the same state is
written with the writer's check switched off. The states hold queued samples with and without
every optional field (sampling masks among them, well-formed or with ids per token, the case
the fault-injection run found), payload segments, routing keys and open groups at every stage
(empty, partly filled, full, over-full).
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import attrs
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import trio_rl.sink._checkpoint_format as checkpoint_mod
from trio_rl.samples import OpenGroup, Prompt, Sample, SampleStatus
from trio_rl.sink import (
    CheckpointError,
    CheckpointSnapshot,
    SinkCounters,
    SinkState,
    SinkWindow,
    TrainingSample,
    decode_checkpoint,
    encode_checkpoint,
)
from trio_rl.wire import MMImageRef, MMRefs, PayloadSegment, RoutedExperts, SamplingMask

#: 2,000 examples under ``thorough`` (the format's robustness bar), fewer in the quicker profiles.
_EXAMPLES = {"dev": 100, "ci": 400, "thorough": 2000}[os.environ.get("HYPOTHESIS_PROFILE", "dev")]

_names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)
_ints32 = st.integers(-(2**31), 2**31 - 1)
_finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
# What MessagePack maps back to the same Python value: no tuples, no NaN (never equal to itself).
_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | _finite
    | _names
    | st.binary(max_size=4),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_names, kids, max_size=3),
    max_leaves=6,
)


@st.composite
def _segments(draw: st.DrawFn, length: int) -> list[PayloadSegment] | None:
    if draw(st.booleans()):
        return None
    out = []
    for _ in range(draw(st.integers(0, 3))):
        pos = draw(st.integers(0, length))
        out.append(
            PayloadSegment(
                draw(st.sampled_from(["routed_experts", "ref_logprobs"])),
                draw(st.sampled_from(["v1/a.bin", "/abs/payload/v2/b.bin"] * 8 + ["../up.bin"])),
                draw(st.integers(0, 2**20)),
                pos,
                draw(st.integers(0, length - pos + draw(st.sampled_from([0] * 15 + [1])))),
                draw(st.sampled_from(["<i4", "uint8", "<f2", "<c8"] * 4 + ["object"])),
                draw(st.lists(st.integers(0, 4), max_size=2)),
            )
        )
    return out


def _or_none(segments: list[PayloadSegment] | None) -> list[PayloadSegment]:
    return [] if segments is None else segments


def _floats(draw: st.DrawFn, n: int) -> list[float]:
    if draw(st.booleans()):
        return [draw(_finite)] * n  # a constant list (packed as value and count)
    return draw(st.lists(_finite, min_size=n, max_size=n))


def _opt_floats(draw: st.DrawFn, n: int) -> list[float] | None:
    return None if draw(st.booleans()) else _floats(draw, n)


@st.composite
def _sampling_mask(draw: st.DrawFn, n: int) -> SamplingMask | None:
    if draw(st.booleans()):
        return None
    counts = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    # ids per token whatever the counts (the shape the fault-injection run found written and
    # then refused), or exactly sum(counts) of them
    n_ids = n if draw(st.integers(0, 7)) == 0 else sum(counts)
    ids = draw(st.lists(_ints32, min_size=n_ids, max_size=n_ids))
    return SamplingMask(struct.pack(f"<{n_ids}i", *ids), struct.pack(f"<{n}i", *counts))


@st.composite
def _training_sample(draw: st.DrawFn) -> TrainingSample:
    n = draw(st.integers(0, 6) if draw(st.integers(0, 19)) == 0 else st.integers(1, 6))
    big = draw(st.integers(0, 9)) == 0
    tokens = draw(
        st.lists(st.integers(-(2**63), 2**63 - 1) if big else _ints32, min_size=n, max_size=n)
    )
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    routed = None
    if draw(st.booleans()):
        k = draw(st.integers(1, 3))
        routed = RoutedExperts(draw(st.binary(min_size=n * k, max_size=n * k)), [n, k], "uint8")
    return TrainingSample(
        token_ids=tokens,
        mask=mask,
        logprobs=_floats(draw, n),
        temperatures=_floats(draw, n),
        env_name=draw(_names),
        advantages=None if draw(st.integers(0, 9)) == 0 else _floats(draw, n),
        ref_logprobs=_opt_floats(draw, n),
        mm_refs=None
        if draw(st.booleans())
        else MMRefs([MMImageRef(draw(_names), draw(st.integers(0, 99)), draw(st.integers(0, 99)))]),
        routed_experts=routed,
        mm_token_type_ids=None
        if draw(st.booleans())
        else draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)),
        rl_weights=_opt_floats(draw, n),
        ce_weights=_opt_floats(draw, n),
        ref_kl_weights=_opt_floats(draw, n),
        sampling_mask=draw(_sampling_mask(n)),
        trace_id=draw(st.none() | _names),
        branch_index=draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        payload=draw(_segments(n)),
        policy_version=draw(st.integers(0, 50)),
        group_id=draw(_names),
        sample_index=draw(st.integers(-1, 10**6)),
        arrival=0,  # set in arrival order below
    )


@st.composite
def _member(draw: st.DrawFn, index: int) -> Sample:
    n = draw(st.integers(0, 5))
    versions = sorted(draw(st.lists(st.integers(0, 9), max_size=3)))
    return Sample(
        index=index,
        group_index=draw(st.integers(0, 99)),
        prompt_tokens=draw(st.lists(_ints32, max_size=4)),
        completion_tokens=draw(st.lists(_ints32, min_size=n, max_size=n)),
        logprobs=_floats(draw, n),
        loss_mask=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        reward=draw(st.none() | _finite),
        status=draw(st.sampled_from([SampleStatus.COMPLETED, SampleStatus.TRUNCATED])),
        policy_versions=versions,
        routing_key=draw(st.none() | _names),  # routing keys, kept across a resume
        seed=draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        label=draw(_plain),
        env_name=draw(_names),
        metadata=draw(st.dictionaries(_names, _plain, max_size=2)),
        payload=_or_none(draw(_segments(n))),
    )


@st.composite
def _open_group(draw: st.DrawFn, i: int) -> OpenGroup:
    size = draw(st.integers(1, 5))
    # every stage: empty, partly filled, full and (rarely) over-full, which no sink saves
    n = draw(st.integers(0, size + 1) if draw(st.integers(0, 19)) == 0 else st.integers(0, size))
    members = [draw(_member(1000 * (i + 1) + j)) for j in range(n)]
    prompt = Prompt(
        draw(_names),
        draw(st.lists(_ints32, max_size=4)),
        label=draw(_plain),
        env_name=draw(_names),
        metadata=draw(st.dictionaries(_names, _plain, max_size=2)),
    )
    return OpenGroup(f"g{i}", prompt, size, members, draw(st.integers(0, 9)))


@st.composite
def _snapshots(draw: st.DrawFn) -> CheckpointSnapshot:
    queued = draw(st.lists(_training_sample(), max_size=4))
    arrival = draw(st.integers(0, 5))
    for ts in queued:
        ts.arrival = arrival
        arrival += draw(st.integers(1, 3))
    groups = tuple(draw(_open_group(i)) for i in range(draw(st.integers(0, 4))))
    held = len(queued) + sum(len(g.arrived) for g in groups)
    shipped, failed = draw(st.integers(0, 99)), draw(st.integers(0, 9))
    window = SinkWindow(
        attempts=draw(st.integers(0, 9)),
        shipped=shipped // 2,
        reward_sum=draw(_finite),
        reward_count=draw(st.integers(0, 9)),
        rewards=draw(st.lists(_finite, max_size=3)),
        completion_lengths=draw(st.lists(st.integers(0, 99), max_size=3)),
        failure_types=draw(st.dictionaries(_names, st.integers(0, 9), max_size=2)),
    )
    state = SinkState(
        step=draw(st.integers(1, 99)),
        next_arrival=arrival,
        counters=SinkCounters(dispatched=shipped + failed + held, shipped=shipped, failed=failed),
        window=window,
        queued=tuple(queued),
        open_groups=groups,
    )
    progress = draw(st.dictionaries(_names, _plain, max_size=3))
    return CheckpointSnapshot(draw(st.integers(0, 99)), progress, draw(_plain), state)


def _float_key(x: float) -> tuple[bool, float]:
    return (math.copysign(1.0, x) < 0, x)  # -0.0 and 0.0 differ in the file: keep them apart


def _canon(value: Any) -> Any:
    """A comparable form: samples (compared by identity) as their fields, floats signed."""
    if isinstance(value, Sample):
        return ("Sample", *(
            _canon(getattr(value, f))
            for f in ("index", "group_index", "prompt_tokens", "completion_tokens", "logprobs",
                      "loss_mask", "reward", "status", "policy_versions", "routing_key", "seed",
                      "label", "env_name", "metadata", "payload")
        ))  # fmt: skip
    if isinstance(value, OpenGroup):
        return ("OpenGroup", value.group_id, _canon(value.prompt), value.group_size,
                _canon(value.arrived), value.policy_version_at_start)  # fmt: skip
    if attrs.has(type(value)):
        return (
            type(value).__name__,
            *(_canon(getattr(value, f.name)) for f in attrs.fields(type(value))),
        )
    if isinstance(value, float):
        return _float_key(value)
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, dict):
        return {k: _canon(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return value


def _unchecked(snap: CheckpointSnapshot, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """``snap`` written with the writer's check switched off (as a writer without it would)."""
    with monkeypatch.context() as m:
        m.setattr(checkpoint_mod, "_judge", lambda name, rec, what, decode: rec)
        m.setattr(checkpoint_mod, "check_state", lambda state: None)
        return encode_checkpoint(snap)


def _encode(snap: CheckpointSnapshot) -> tuple[bytes, CheckpointError | None]:
    try:
        return encode_checkpoint(snap), None
    except CheckpointError as exc:
        return b"", exc


@settings(max_examples=_EXAMPLES)
@given(_snapshots())
def test_what_the_writer_accepts_reads_back_equal_and_what_it_refuses_the_reader_refuses(
    snap: CheckpointSnapshot,
) -> None:
    data, refused = _encode(snap)
    if refused is not None:
        event("refused by the writer")
        assert refused.path == "<memory>"
        with pytest.MonkeyPatch.context() as mp:
            unchecked = _unchecked(snap, mp)
        # the same rules: what the writer refused, the reader refuses when it is on disk
        with pytest.raises(CheckpointError) as read:
            decode_checkpoint(unchecked, "x.ckpt")
        field = str(refused).removeprefix("checkpoint <memory>: ").split(":")[0]
        assert field in str(read.value), (str(refused), str(read.value))
        return
    event("written and read back")
    ck = decode_checkpoint(data, "x.ckpt")
    assert (ck.step, _canon(ck.progress), _canon(ck.cursor)) == (
        snap.step,
        _canon(dict(snap.progress)),
        _canon(snap.cursor),
    )
    assert _canon(ck.sink) == _canon(snap.sink)
    # and what was read is written again byte for byte
    assert encode_checkpoint(CheckpointSnapshot(ck.step, ck.progress, ck.cursor, ck.sink)) == data


def test_a_sampling_mask_with_ids_per_token_is_refused_before_anything_is_written(
    tmp_path: Any,
) -> None:
    n = 4
    ts = TrainingSample(
        token_ids=[1, 2, 3, 4],
        mask=[False, True, True, True],
        logprobs=[0.0] * n,
        temperatures=[1.0] * n,
        env_name="e",
        advantages=[0.5] * n,
        # a count of 0 for some tokens, but one id for every token
        sampling_mask=SamplingMask(struct.pack("<4i", 7, 8, 9, 10), struct.pack("<4i", 0, 1, 1, 0)),
        arrival=0,
    )
    state = SinkState(1, 1, SinkCounters(dispatched=1), SinkWindow(), (ts,), ())
    snap = CheckpointSnapshot(1, {}, None, state)
    with pytest.raises(
        CheckpointError, match=r"sink\.queued\[0\]\.sampling_mask\.ids: 16 bytes for 2"
    ):
        encode_checkpoint(snap)
    target = tmp_path / "step_00000001.ckpt"
    with pytest.raises(CheckpointError, match="refused by the writer"):
        checkpoint_mod.write_checkpoint(target, snap)
    assert list(tmp_path.iterdir()) == []  # not even a temporary file
