"""``trio-rl inspect``: real run directories, real batch files and checkpoints, damaged copies."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from tools_helpers import simulate, trio_rl

from trio_rl.errors import CheckpointError, TrioRLError, WireFormatError
from trio_rl.sink import CheckpointManager, read_checkpoint
from trio_rl.tools import JsonlSink
from trio_rl.tools.inspect_cmd import inspect_path, render
from trio_rl.transport import FileSender, batch_path
from trio_rl.wire import MicroBatch, PayloadSegment, encode


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return simulate(tmp_path_factory.mktemp("sim") / "run", steps=2)


def _one_line_error(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _data(path: Path) -> dict[str, Any]:
    """In process, what ``--json`` prints (the subprocess tests cover the command itself)."""
    data = json.loads(json.dumps(inspect_path(path).data, default=str))
    assert isinstance(data, dict)
    return data


def _error(path: Path, *needles: str) -> None:
    with pytest.raises(TrioRLError) as caught:
        inspect_path(path)
    for needle in needles:
        assert needle in str(caught.value), str(caught.value)


def _json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert isinstance(data, dict)
    return data


def test_a_simulated_run_directory(sim_run: Path) -> None:
    data = _json(trio_rl("inspect", str(sim_run), "--json"))
    assert data["kind"] == "run directory"
    ckpts = data["checkpoints"]
    assert isinstance(ckpts, dict)
    assert ckpts["steps"] == [1, 2]
    newest = ckpts["newest"]
    ckpt = read_checkpoint(sim_run / "checkpoints" / "step_00000002.ckpt")
    assert newest["step"] == 2
    assert newest["next_step"] == 3
    # simulate's defaults: 8 groups x 8 samples per step
    assert newest["counters"]["shipped"] == 2 * 64
    assert newest["counters"]["dispatched"] == ckpt.sink.counters.dispatched
    assert newest["open_groups"]["groups"] == len(ckpt.sink.open_groups)
    assert newest["queued"]["samples"] == len(ckpt.sink.queued)
    assert newest["progress"] == dict(ckpt.progress)
    assert data["trainer"] == {
        "rank 0": {"steps": "1..2", "lines": 2},
        "rank 1": {"steps": "1..2", "lines": 2},
    }
    assert data["batches"]["pending"] == "none (every batch was read)"


def test_the_text_summary_reads_as_sections(sim_run: Path) -> None:
    done = trio_rl("inspect", str(sim_run))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "kind: run directory" in out
    assert "checkpoints:\n  files: 2\n  steps: [1, 2]\n  newest:\n" in out
    assert "    next step: 3\n" in out
    assert "trainer:\n  rank 0:\n    steps: 1..2\n" in out


def test_a_checkpoint_file(sim_run: Path) -> None:
    path = sim_run / "checkpoints" / "step_00000001.ckpt"
    data = _data(path)
    ckpt = read_checkpoint(path)
    assert data["kind"] == "checkpoint"
    assert data["step"] == 1
    members = sum(len(og.arrived) for og in ckpt.sink.open_groups)
    assert data["open_groups"]["members_arrived"] == members
    assert data["open_groups"]["members_expected"] == sum(
        og.group_size for og in ckpt.sink.open_groups
    )
    assert data["payload_files"] == {"referenced": 0, "missing": []}


def _rewrite_body(src: Path, dst: Path, edit: object) -> None:
    """Re-encode a checkpoint with its header record edited, with a valid length and crc, so
    only the field check can find the damage."""
    raw = src.read_bytes()
    body = raw[16:-20]
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(body)
    objects = list(unpacker)
    assert callable(edit)
    edit(objects[0])
    new = b"".join(msgpack.packb(o, use_bin_type=True) for o in objects)
    trailer = struct.pack("<QI8s", len(new), zlib.crc32(new), b"TRIOEND!")
    dst.write_bytes(raw[:16] + new + trailer)


def test_damaged_checkpoints_are_one_line_naming_file_and_place(
    sim_run: Path, tmp_path: Path
) -> None:
    good = sim_run / "checkpoints" / "step_00000002.ckpt"
    flipped = tmp_path / "step_00000002.ckpt"
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    _one_line_error(trio_rl("inspect", str(flipped)), str(flipped), "checksum mismatch")

    truncated = tmp_path / "step_00000003.ckpt"
    truncated.write_bytes(good.read_bytes()[:-7])
    _error(truncated, str(truncated), "truncated")

    bad_field = tmp_path / "step_00000004.ckpt"
    _rewrite_body(good, bad_field, lambda meta: meta.__setitem__("n_queued", "three"))
    with pytest.raises(CheckpointError):
        read_checkpoint(bad_field)
    _error(bad_field, str(bad_field), "n_queued", "byte offset 16")


def test_a_run_directory_with_a_damaged_checkpoint(sim_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(sim_run, run)
    newest = run / "checkpoints" / "step_00000002.ckpt"
    newest.write_bytes(newest.read_bytes()[:100])
    done = trio_rl("inspect", str(run))
    # the summary still shows what is readable, then the damage is the one error line
    assert "steps: [1, 2]" in done.stdout
    assert f"DAMAGED: checkpoint {newest}" in done.stdout
    _one_line_error(done, str(newest), "truncated")


def _micro_batches(payload_file: Path, missing: Path) -> list[MicroBatch]:
    def mb(n: int, segments: list[PayloadSegment] | None) -> MicroBatch:
        return MicroBatch(
            input_ids=list(range(n)),
            loss_mask=[i >= 2 for i in range(n)],
            advantages=[0.5] * n,
            inference_logprobs=[-1.0] * n,
            position_ids=list(range(n)),
            sequence_lengths=[n],
            temperatures=[1.0] * n,
            env_names=["math"],
            seq_lens=[n],
            payload=segments,
        )

    seg = PayloadSegment("routed_experts", str(payload_file), 0, 0, 2, "<i4", [1])
    gone = PayloadSegment("routed_experts", str(missing), 0, 0, 2, "<i4", [1])
    return [mb(6, [seg]), mb(10, [gone])]


async def _send(directory: Path, payloads: list[bytes]) -> None:
    async with FileSender(directory, len(payloads)) as sender:
        await sender.send(7, payloads)


def test_a_batch_file_written_by_the_file_sender(tmp_path: Path) -> None:
    present, missing = tmp_path / "v0" / "a.bin", tmp_path / "v0" / "gone.bin"
    present.parent.mkdir()
    present.write_bytes(b"\0" * 8)
    payload = encode(_micro_batches(present, missing))
    trio.run(_send, tmp_path, [payload])
    path = batch_path(tmp_path, 7, 0)
    data = _json(trio_rl("inspect", str(path), "--json"))
    assert data["step"] == 7
    assert data["rank"] == 0
    assert data["micro_batches"] == 2
    assert data["tokens"] == 16
    assert data["tokens_per_micro_batch"] == [6, 10]
    assert data["loss_tokens"] == 4 + 8
    assert data["sequences"] == 2
    assert data["env_names"] == ["math"]
    assert data["optional_fields"] == ["payload"]
    assert data["payload_files"] == {"referenced": 2, "missing": [str(missing)]}
    text = "\n".join(render(inspect_path(path).data)) + "\n"
    assert "micro batches: 2\n" in text
    assert f'missing: 1 ["{missing}"]' in text
    # the run directory around it lists the pending file
    run = _data(tmp_path)
    assert run["batches"]["pending"]["step 7 rank 0"]["tokens"] == 16


def test_damaged_batch_files_name_file_offset_and_field(tmp_path: Path) -> None:
    payload = encode(_micro_batches(tmp_path / "x", tmp_path / "y"))
    truncated = tmp_path / "rank_0.bin"
    truncated.write_bytes(payload[:-5])
    with pytest.raises(WireFormatError) as caught:
        inspect_path(truncated)
    assert caught.value.source == str(truncated)
    assert f"byte offset {caught.value.offset}" in str(caught.value)

    # a loss mask of ints: well-formed MessagePack, the wrong type in one field
    fields = [
        [0, 1, 2],
        [1, 0, 1],
        [0.0] * 3,
        [0.0] * 3,
        [0, 1, 2],
        [3],
        [1.0] * 3,
        ["e"],
        [3],
    ]
    wrong = tmp_path / "wrong.bin"
    wrong.write_bytes(msgpack.packb([fields], use_bin_type=True))
    _one_line_error(
        trio_rl("inspect", str(wrong)), str(wrong), "field 'loss_mask[0]'", "byte offset 7"
    )


def test_an_outbox_written_by_the_checkpoint_manager(tmp_path: Path) -> None:
    payload = encode(_micro_batches(tmp_path / "x", tmp_path / "y"))
    path = CheckpointManager(tmp_path).write_outbox(3, [payload, payload])
    data = _data(path)
    assert data["kind"] == "outbox"
    assert data["step"] == 3
    assert sorted(data["ranks"]) == ["rank 0", "rank 1"]
    assert data["ranks"]["rank 1"]["tokens"] == 16
    damaged = tmp_path / "copy" / path.name
    damaged.parent.mkdir()
    damaged.write_bytes(path.read_bytes()[:-3])
    _error(damaged, str(damaged), "outbox")


def test_paths_that_are_not_runs(tmp_path: Path) -> None:
    _one_line_error(trio_rl("inspect", str(tmp_path)), str(tmp_path), "not a run directory")
    gone = tmp_path / "nope"
    _error(gone, str(gone), "no such file")


def test_a_metrics_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (1, 2, 3):
        sink.write({"step": step, "samples": 8, "tokens": 100, "reward_mean": step / 10})
    sink.write({"step": 4, "samples": None, "reward_mean": None})  # null counts nothing
    sink.close()
    data = _data(path)
    assert data["kind"] == "metrics file"
    assert data["records"] == 4
    assert data["steps"] == "1..4"
    assert data["samples"] == 24
    assert data["tokens"] == 300
    assert data["last"] == {"step": 4, "reward_mean": None}
    with path.open("a") as f:
        f.write('"just a string"\n')
    _error(path, str(path), "line 5", "not a JSON object")
