"""Real run directories for the tools' tests, made by the library's own commands."""

from __future__ import annotations

import importlib
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

_LEARN = (
    "import sys, torch, trio; torch.set_num_threads(1); "
    "from trio_rl.config import LearnRunConfig, configure; "
    "from trio_rl.learn import run_learning; "
    "trio.run(run_learning, configure(LearnRunConfig, {'run.out': sys.argv[1], 'run.steps': 4, "
    "'rollout.batch_groups': 2, 'rollout.group_size': 8, 'metrics.console': False, "
    "'metrics.plot': False}))"
)


def simulate(out: Path, steps: int = 2) -> Path:
    """``trio-rl simulate`` for ``steps`` steps into ``out`` (checkpoints, trainer logs)."""
    done = subprocess.run(
        [sys.executable, "-m", "trio_rl", "simulate", "--steps", str(steps), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return out


def learn(out: Path) -> Path:
    """A short learning run into ``out`` (run.json, metrics.jsonl, weights/, batches/)."""
    done = subprocess.run(
        [sys.executable, "-c", _LEARN, str(out)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    return out


def trio_rl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The real ``trio-rl`` command (``python -m trio_rl``)."""
    cmd = [sys.executable, "-m", "trio_rl", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def extra(module: str) -> Any:
    """Import an optional extra's package for a test. The test dependency group installs every
    extra, so a missing one fails the test (naming the package) instead of passing by skipping."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module!r} is not installed: install the test dependency group ({exc})")


def tf_events(logdir: Path) -> list[bytes]:
    """The records of the TFRecord event files under ``logdir`` (length, crc, data, crc)."""
    out = []
    for file in sorted(logdir.glob("events.out.tfevents.*")):
        data = file.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack_from("<Q", data, pos)
            out.append(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4
    return out


def tf_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar in the event files under ``logdir``."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, dict[int, float]] = {}
    for raw in tf_events(logdir):
        event = Event.FromString(raw)
        for value in event.summary.value:
            scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def wandb_records(run_file: Path) -> list[Any]:
    """The ``Record`` protobufs of an offline ``.wandb`` file: a 7-byte header, then LevelDB-log
    records (crc32c u32, length u16, type u8; 1 full, 2 first, 3 middle, 4 last) in 32 KiB
    blocks."""
    # generated protobuf code: its stubs do not name the message classes
    pb: Any = importlib.import_module("wandb.proto.wandb_internal_pb2")

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, part, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer too short for a record header
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack_from("<IHB", data, pos)
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        part = chunk if kind in (1, 2) else part + chunk
        if kind not in (1, 4):
            continue
        record = pb.Record()
        record.ParseFromString(part)
        records.append(record)
    return records


def wandb_rows(run_file: Path) -> list[dict[str, Any]]:
    """The history rows of an offline run file, in the order they were logged."""
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def wandb_history(run_file: Path) -> dict[int, dict[str, Any]]:
    """The history rows of an offline run file by the record's ``step`` (the charts' x axis;
    a later row of one step adds to the earlier one's fields)."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in wandb_rows(run_file):
        by_step.setdefault(int(row["step"]), {}).update(row)
    return by_step
