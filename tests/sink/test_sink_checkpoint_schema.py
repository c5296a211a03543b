"""Well-checksummed but wrong checkpoints: anything that loads resumes, the rest is named.

Real checkpoints of a real sink are decoded into their MessagePack records, mutated (a node of
another type, wrong lengths, huge counts, negative numbers, NaN, typed arrays of the wrong size,
duplicated or surplus members, versions out of order) and re-encoded with a correct checksum, so
that what is tested is the structure validation, not the CRC.
"""

from __future__ import annotations

import math
import re
import struct
import zlib
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest
import trio
from hypothesis import event, given, settings
from hypothesis import strategies as st
from sink_helpers import assert_accounted

from builders import make_group, make_sample
from conftest import scaled
from trio_rl.publish import pack_samples
from trio_rl.samples import Prompt, Sample, SampleStatus
from trio_rl.sink import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    PruneMode,
    RunBounds,
    SinkConfig,
    TrainSink,
    TrainSinkError,
    check_run_bounds,
    decode_checkpoint,
    encode_checkpoint,
)
from trio_rl.trainer import to_torch
from trio_rl.wire import (
    MMImageRef,
    MMRefs,
    PayloadSegment,
    RoutedExperts,
    SamplingMask,
    decode,
    encode,
)

_HEAD, _TAIL = 16, 20
_NAME = "mut.ckpt"
# the message after the file names a field path such as sink.open_groups[3].members[1].logprobs
_FIELD = re.compile(
    r"^checkpoint mut\.ckpt: (meta|step|progress|cursor|sink|n_queued|n_open)"
    r"(\.[a-z_]+|\[\d+\])*: "
)


#: The group size of the run every base checkpoint comes from.
GROUP_SIZE = 4


def _rich_sink(n_open: int = 2) -> TrainSink:
    """A sink that has shipped a batch and holds every kind of record a checkpoint can carry,
    with ``n_open`` open groups of `GROUP_SIZE` (the first with rich members, the next empty,
    the others at every stage: 0 to 3 members)."""
    sink = TrainSink(SinkConfig(batch_size=2, max_off_policy_steps=None))
    sink.add_group(make_group([1.0, 0.0], version=0))
    sink.settle_batch(sink.detach_batch())
    sink.add_group(make_group([1.0, 0.0, 0.25], version=1))
    sink.record_failed(2)
    rich = sink.queued_samples()[0]
    n = rich.num_tokens
    rich.ref_logprobs = [-0.25] * (n - 1) + [-1.5]
    rich.mm_refs = MMRefs([MMImageRef("file:///a.png", 3, 99)])
    rich.routed_experts = RoutedExperts(bytes(range(2 * n)), [n, 1, 2], "uint8")
    rich.mm_token_type_ids = [0, 1] + [0] * (n - 2)
    rich.rl_weights = [1.0] * n
    rich.ce_weights = [0.0] * n
    rich.ref_kl_weights = [0.5] * n
    counts = [1 if i % 2 else 0 for i in range(n)]
    rich.sampling_mask = SamplingMask(
        struct.pack(f"<{sum(counts)}i", *range(sum(counts))), struct.pack(f"<{n}i", *counts)
    )
    rich.trace_id, rich.branch_index = "trace-1", 2
    rich.payload = [PayloadSegment("routed_experts", "v1/x.bin", 8, 1, n - 1, "<i4", [2, 3])]
    if n_open < 1:
        return sink
    prompt = Prompt("k1", (1, 2, 3), label={"answer": 4}, env_name="math")
    sink.open_group("open-1", prompt, GROUP_SIZE, 1)
    member = make_sample(9, 1.0, version=1, index=900)
    member.policy_versions = [1, 2]
    member.metadata = {"turns": 2}
    member.payload = (PayloadSegment("routed_experts", "v1/y.bin", 0, 3, 4, "<i4", [2]),)
    sink.add_member("open-1", member)
    sink.add_member("open-1", make_sample(9, 0.0, version=2, index=901))
    sink.add_member("open-1", make_sample(9, 0.0, version=2, index=902, status=SampleStatus.FAILED))
    if n_open >= 2:
        sink.open_group("open-empty", Prompt("k2", (7,)), GROUP_SIZE, 2)
    for k in range(n_open - 2):
        gid = f"open-{k + 2}"
        sink.open_group(gid, Prompt(f"k{k + 3}", (5, k)), GROUP_SIZE, 2)
        for j in range(k % GROUP_SIZE):
            sink.add_member(gid, make_sample(9, float(j % 2), version=2, index=2000 + 8 * k + j))
    return sink


def _blob(n_open: int = 2) -> bytes:
    sink = _rich_sink(n_open)
    assert_accounted(sink)
    snap = CheckpointManager("unused").snapshot(
        sink, cursor={"source": {"epoch": 1}}, progress={"policy_version": 2}
    )
    return encode_checkpoint(snap)


BLOB = _blob()


def _records(data: bytes) -> list[Any]:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data[_HEAD:-_TAIL])
    return list(unpacker)


RECORDS = _records(BLOB)
#: Base checkpoints by their number of open groups: the mutation test draws from all of them
#: (a defect can depend on how many groups a resume continues).
BASES = {n: _records(_blob(n)) for n in (0, 1, 2, 7, 13, 16)}


def _file(objs: list[Any]) -> bytes:
    body = b"".join(msgpack.packb(o, use_bin_type=True) for o in objs)
    head = struct.pack("<8sHHI", b"TRIORLCK", 1, 0, 0)
    return head + body + struct.pack("<QI8s", len(body), zlib.crc32(body), b"TRIOEND!")


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, list):
        for i, child in enumerate(node):
            out += _paths(child, (*path, i))
    elif isinstance(node, dict):
        for k, child in node.items():
            out += _paths(child, (*path, k))
    return out


_ELEMENT_TYPES = [1, 2, 3, 4, 5]

_OTHER = st.sampled_from(
    [
        None,
        True,
        0,
        -1,
        7,
        2**31,
        2**63 - 1,
        2**64 - 1,
        -(2**63),
        1.5,
        math.nan,
        math.inf,
        -0.0,
        "",
        "x",
        "../../etc/passwd",
        b"",
        b"\x00\x01\x02",
        [],
        [1, 2],
        [[1]],
        {},
        {"a": 1},
        {"step": 1},
        msgpack.ExtType(1, b"\x01\x00\x00\x00"),
        msgpack.ExtType(2, b"\x01" * 7),
        msgpack.ExtType(3, b"\x00" * 12),
        msgpack.ExtType(4, b"\x01\x00\x05"),
        msgpack.ExtType(5, struct.pack("<dQ", 1.0, 2**63)),
        msgpack.ExtType(5, struct.pack("<dQ", 1.0, 3) + b"\x00"),
        msgpack.ExtType(42, b""),
    ]
)


@st.composite
def _mutation(draw: st.DrawFn, node: Any) -> Any:
    """A replacement for ``node``: usually something near it, sometimes anything at all."""
    if draw(st.integers(0, 3)) == 0:
        return draw(_OTHER)
    if isinstance(node, bool):
        return not node
    if isinstance(node, int):
        near = [node + 1, node - 1, -node - 1, 0, 2**63, 2**64 - 1, -(2**63)]
        return draw(st.sampled_from([v for v in near if -(2**63) <= v < 2**64]))
    if isinstance(node, float):
        return draw(st.sampled_from([math.nan, -math.inf, math.inf, -node, 1e308]))
    if isinstance(node, str):
        return draw(st.sampled_from(["", node + "x", "\x00", 3, None]))
    if isinstance(node, msgpack.ExtType):
        data = node.data
        return draw(
            st.sampled_from(
                [
                    msgpack.ExtType(draw(st.sampled_from(_ELEMENT_TYPES)), data),
                    msgpack.ExtType(node.code, data[:-1]),
                    msgpack.ExtType(node.code, data[: len(data) // 2]),
                    msgpack.ExtType(node.code, data + data[:8]),
                    msgpack.ExtType(node.code, data + b"\x00"),
                    msgpack.ExtType(5, struct.pack("<dQ", 0.5, draw(st.integers(0, 2**64 - 1)))),
                    data,
                ]
            )
        )
    if isinstance(node, list):
        if not node:
            return [draw(_OTHER)]
        i = draw(st.integers(0, len(node) - 1))
        j = draw(st.integers(0, len(node) - 1))
        swapped = list(node)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        return draw(
            st.sampled_from(
                [
                    node[:i] + node[i + 1 :],
                    [*node, node[i]],
                    [*node, node[i], node[j]],
                    swapped,
                    node[:-1],
                    [],
                    [*node, draw(_OTHER)],
                ]
            )
        )
    if isinstance(node, dict):
        keys = sorted(node, key=str)
        if not keys:
            return {"x": draw(_OTHER)}
        k = draw(st.sampled_from(keys))
        return draw(
            st.sampled_from(
                [
                    {kk: v for kk, v in node.items() if kk != k},
                    {**node, "unknown": 1},
                    {**node, k: draw(_OTHER)},
                    {**node, 3: "int key"},
                ]
            )
        )
    return draw(_OTHER)


def _replace(root: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(root, list):
        out = list(root)
        out[head] = _replace(root[head], rest, value)
        return out
    assert isinstance(root, dict)
    return {**root, head: _replace(root[head], rest, value)}


def _get(root: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        root = root[p]
    return root


def _path_of(path: tuple[Any, ...], n_queued: int) -> str:
    """The field path a checkpoint error should name for a mutation of record ``path[0]``."""
    rec = path[0]
    if rec == 0:
        return ""
    if rec <= n_queued:
        return f"sink.queued[{rec - 1}]"
    return f"sink.open_groups[{rec - 1 - n_queued}]"


_CONFIGS = [
    SinkConfig(batch_size=2, max_off_policy_steps=None),
    SinkConfig(batch_size=3, max_off_policy_steps=1, prune=PruneMode.AFTER_SELECTION),
    SinkConfig(token_batch_size=8, max_off_policy_steps=0),
]


def _resume_and_continue(ck: Checkpoint, config: SinkConfig) -> None:
    """Restore into a fresh sink, finish its groups, ship everything, snapshot and reload."""
    sink = TrainSink(config)
    report = sink.load_state_dict(ck.sink, missing_files=ck.missing_files)
    assert_accounted(sink)
    next_index = 10**6
    for rg in report.resumed:
        for _ in range(rg.missing):
            sink.add_member(
                rg.group_id, make_sample(1, float(next_index % 3), version=5, index=next_index)
            )
            next_index += 1
    assert not sink.open_group_ids()
    sink.add_group(make_group([0.0, 1.0], version=5))

    async def ship_all() -> None:
        with trio.fail_after(20):
            while sink.queued:
                batch = await sink.take_batch(force=True)
                if not batch.samples:
                    continue
                for rank in pack_samples(batch.samples, seq_len=16, num_ranks=2):
                    for mb in decode(encode(rank)):
                        to_torch(mb)

    trio.run(ship_all)
    assert_accounted(sink)
    again = decode_checkpoint(
        encode_checkpoint(
            CheckpointManager("unused").snapshot(sink, cursor=ck.cursor, progress=ck.progress)
        ),
        _NAME,
    )
    assert again.sink.counters == sink.counters
    TrainSink(config).load_state_dict(again.sink)


def _bounds_error(ck: Checkpoint) -> CheckpointError | None:
    try:
        check_run_bounds(ck, RunBounds(group_size=GROUP_SIZE))
    except CheckpointError as exc:
        return exc
    return None


def _decode(data: bytes) -> tuple[Checkpoint | None, CheckpointError | None]:
    try:
        return decode_checkpoint(data, _NAME), None
    except CheckpointError as exc:
        return None, exc


def test_the_intact_checkpoint_reencodes_identically_and_resumes() -> None:
    assert _file(RECORDS) == BLOB
    ck = decode_checkpoint(BLOB, _NAME)
    assert len(ck.sink.queued) == 3
    assert [len(g.arrived) for g in ck.sink.open_groups] == [2, 0]
    for config in _CONFIGS:
        _resume_and_continue(ck, config)


@settings(max_examples=scaled(400))
@given(st.data())
def test_well_checksummed_mutation_is_named_or_resumes(data: st.DataObject) -> None:
    n_open = data.draw(st.sampled_from(sorted(BASES)), label="open groups in the base")
    base = records = BASES[n_open]
    event(f"base with {n_open} open groups")
    n_mut = data.draw(st.integers(1, 3), label="mutations")
    first: tuple[Any, ...] = ()
    n_q = base[0]["n_queued"]
    # the fault-injection run's case, weighted up: an open group's size (1,000,000, say)
    sizes = [(1 + n_q + i, 2) for i in range(n_open)] * 50
    for k in range(n_mut):
        paths = _paths(records)[1:] + (sizes if k == 0 else [])
        path = data.draw(st.sampled_from(paths), label="path")
        first = first or path
        records = _replace(records, path, data.draw(_mutation(_get(records, path))))
    if data.draw(st.booleans(), label="recount"):
        # keep the record counts consistent with the records, so that the records are judged
        meta = records[0]
        declared = meta.get("n_open") if isinstance(meta, dict) else None
        if type(declared) is int and declared < 2**62:
            meta = {**meta, "n_queued": len(records) - 1 - meta["n_open"]}
            records = [meta, *records[1:]]
    ck, error = _decode(_file(records))
    if ck is not None:
        # checked against the run that restores it: a group size other than the configured
        # one (a mutation to a million members, say) is refused before anything is restored
        refused = _bounds_error(ck)
        if refused is not None:
            event("refused by the run's bounds")
            assert refused.path == _NAME
            field, values = str(refused).removeprefix(f"checkpoint {_NAME}: ").split(": ", 1)
            assert re.fullmatch(r"sink\.open_groups\[\d+\]\.group_size", field), str(refused)
            got = _get(records, (1 + records[0]["n_queued"] + int(field[17:-12]), 2))
            assert values.startswith(f"{got} in the checkpoint, {GROUP_SIZE} configured"), values
            return
    if error is not None:
        event("rejected")
        assert error.path == _NAME
        assert _FIELD.match(str(error)), str(error)
        if n_mut == 1 and first[0] != 0 and not isinstance(_get(records, first), (list, dict)):
            # a single scalar replaced inside a record is reported at that record, or at the
            # cross-field invariant it breaks (accounting, arrival order, a duplicate)
            where = _path_of(first, base[0]["n_queued"])
            msg = str(error)
            cross = ("sink.counters", "arrival order", "duplicate")
            assert where in msg or any(c in msg for c in cross), msg
        return
    assert ck is not None
    event("loaded and resumed")
    config = data.draw(st.sampled_from(_CONFIGS), label="config")
    _resume_and_continue(ck, config)


@pytest.mark.parametrize("n_open", [n for n in sorted(BASES) if n])
def test_a_million_members_is_refused_before_anything_is_restored(n_open: int) -> None:
    base = BASES[n_open]
    last = base[0]["n_queued"] + n_open  # the last open group's record
    ck = decode_checkpoint(_file(_replace(base, (last, 2), 1_000_000)), _NAME)  # it loads
    with pytest.raises(CheckpointError) as info:
        check_run_bounds(ck, RunBounds(group_size=GROUP_SIZE))
    assert str(info.value).startswith(
        f"checkpoint {_NAME}: sink.open_groups[{n_open - 1}].group_size: 1000000 in the "
        f"checkpoint, {GROUP_SIZE} configured: a configuration change"
    ), str(info.value)


@pytest.mark.parametrize("n_open", sorted(BASES))
def test_every_base_resumes_intact(n_open: int) -> None:
    ck = decode_checkpoint(_file(BASES[n_open]), _NAME)
    assert len(ck.sink.open_groups) == n_open
    check_run_bounds(ck, RunBounds(group_size=GROUP_SIZE))
    for config in _CONFIGS:
        _resume_and_continue(ck, config)


def _with(path: tuple[Any, ...], value: Any) -> bytes:
    return _file(_replace(RECORDS, path, value))


def _error(data: bytes) -> str:
    with pytest.raises(CheckpointError) as info:
        decode_checkpoint(data, _NAME)
    assert info.value.path == _NAME
    return str(info.value)


def test_field_paths_name_the_exact_field() -> None:
    n_q = RECORDS[0]["n_queued"]
    open1 = 1 + n_q
    member_logprobs = (open1, 4, 0, 4)
    msg = _error(_with(member_logprobs, [-0.5, -0.6]))
    assert msg.startswith(f"checkpoint {_NAME}: sink.open_groups[0].members[0].logprobs: "), msg
    assert "byte offset" in msg
    msg = _error(_with((0, "step"), "7"))
    assert msg.startswith(f"checkpoint {_NAME}: step: expected an integer"), msg
    msg = _error(_with((0, "sink", "counters"), "counters"))
    assert msg.startswith(f"checkpoint {_NAME}: sink.counters: expected a map"), msg
    msg = _error(_with((2, 2), msgpack.ExtType(3, b"\x00" * 9)))
    assert msg.startswith(f"checkpoint {_NAME}: sink.queued[1].logprobs: "), msg


@pytest.mark.parametrize("count", [2**31, 2**63, 2**64 - 1])
def test_huge_counts_are_bounded_by_the_bytes_left(count: int) -> None:
    # a constant list claiming ``count`` elements, and record counts beyond the file
    assert "sink.queued[0].temperatures" in _error(
        _with((1, 3), msgpack.ExtType(5, struct.pack("<dQ", 1.0, count)))
    )
    assert "n_queued" in _error(_with((0, "n_queued"), count))
    assert "n_open" in _error(_with((0, "n_open"), count))


def test_structural_invariants_are_enforced() -> None:
    n_q = RECORDS[0]["n_queued"]
    open1 = 1 + n_q
    members = RECORDS[open1][4]
    msg = _error(_with((open1, 4), [members[0], members[0]]))
    assert "sink.open_groups[0].members[1].index" in msg, msg
    assert "duplicate" in msg, msg
    msg = _error(_with((open1, 2), 1))
    assert "sink.open_groups[0].members" in msg, msg
    assert "group_size" in msg, msg
    msg = _error(_with((open1, 4, 0, 8), [2, 1]))
    assert "sink.open_groups[0].members[0].policy_versions" in msg, msg
    msg = _error(_with((open1 + 1, 0), "open-1"))
    assert "sink.open_groups[1].group_id" in msg, msg
    assert "duplicate" in msg, msg
    msg = _error(_with((2, 20), RECORDS[1][20]))
    assert "sink.queued[1].arrival" in msg, msg
    msg = _error(_with((0, "sink", "counters", "dispatched"), 3))
    assert "sink.counters" in msg, msg


async def test_read_latest_falls_back_on_a_well_checksummed_bad_checkpoint(
    tmp_path: Path,
) -> None:
    mgr = CheckpointManager(tmp_path, keep=5)
    sink = _rich_sink()
    first = await mgr.save(mgr.snapshot(sink, step=1, cursor="first"))
    second = await mgr.save(mgr.snapshot(sink, step=2, cursor="second"))
    records = _records(second.read_bytes())
    records[0] = {**records[0], "n_queued": 2**63}
    second.write_bytes(_file(records))
    latest = await mgr.load_latest()
    assert latest is not None
    assert latest.path == first
    records = _records(first.read_bytes())
    records[1] = _replace(records[1], (3,), msgpack.ExtType(5, struct.pack("<dQ", 1.0, 2**63)))
    first.write_bytes(_file(records))
    assert mgr.read_latest() is None


def test_member_sample_type_survives_roundtrip() -> None:
    ck = decode_checkpoint(BLOB, _NAME)
    member = ck.sink.open_groups[0].arrived[0]
    assert isinstance(member, Sample)
    assert member.payload[0].file == "v1/y.bin"


def test_load_state_dict_refuses_a_broken_state_and_changes_nothing() -> None:
    state = _rich_sink().state_dict()
    broken = attrs.evolve(
        state, counters=attrs.evolve(state.counters, dispatched=state.counters.dispatched + 1)
    )
    sink = TrainSink(SinkConfig(batch_size=2))
    sink.add_group(make_group([1.0, 0.0]))
    before = (sink.step, sink.counters, sink.queued, sink.open_group_ids())
    with pytest.raises(TrainSinkError, match=r"restore: counters\.dispatched: "):
        sink.load_state_dict(broken)
    assert (sink.step, sink.counters, sink.queued, sink.open_group_ids()) == before
    twice = attrs.evolve(state, open_groups=(*state.open_groups, state.open_groups[0]))
    with pytest.raises(TrainSinkError, match=r"open_groups\[2\]\.group_id: duplicate"):
        sink.load_state_dict(twice)
