"""A batch shipped by the real orchestrator with by-handle payloads is readable, payloads
included, by a prime-rl style reader in another process and working directory, and by
`BatchReceiver.receive_tensors`; the files go only once the step is handed over."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import trio

from trio_rl.engines import SamplingParams, SimulatedEngine
from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
from trio_rl.payloads import PayloadStore
from trio_rl.rollout import InMemorySource, engine_generate
from trio_rl.samples import Prompt, Sample
from trio_rl.sink import SinkConfig
from trio_rl.trainer import BatchReceiver, payload_files
from trio_rl.transport import MemorySender, ReceivedPayload, Receiver
from trio_rl.wire import MicroBatch, decode

G = 4

# What prime-rl's trainer does with a segment: open ``segment.file`` as given, pread at the
# offset, view rows x shape x dtype; a ragged field's rows are uint32 file offsets (+1 end).
PRIME_RL_READER = r"""
import json, math, os, sys
import numpy as np

RAGGED = {"sampling_mask": "<i4", "sampling_mask_logprobs": "<f4"}
out = []
for seg in json.load(sys.stdin):
    fd = os.open(seg["file"], os.O_RDONLY)
    try:
        dtype = np.dtype(seg["dtype"])
        size = seg["rows"] * dtype.itemsize * math.prod(seg["shape"])
        if seg["field"] in RAGGED:
            offs = np.frombuffer(os.pread(fd, 4 * (seg["rows"] + 1), seg["offset"]), "<u4")
            values = np.dtype(RAGGED[seg["field"]])
            rows = [
                np.frombuffer(os.pread(fd, int(b - a), int(a)), values).tolist()
                for a, b in zip(offs[:-1], offs[1:])
            ]
        else:
            raw = os.pread(fd, size, seg["offset"])
            rows = np.frombuffer(raw, dtype).reshape(seg["rows"], *seg["shape"]).tolist()
    finally:
        os.close(fd)
    out.append(rows)
json.dump({"cwd": os.getcwd(), "rows": out}, sys.stdout)
"""


def _reward(sample: Sample) -> float:
    return float(sample.index % G)


def _mask_row(token: int, i: int) -> list[int]:
    return [token] * (i % 3 + 1)  # ragged: 1 to 3 allowed ids per position


class _Tap(Receiver):
    """Delegates to a real receiver; on each receive, checks that the step's payload files all
    exist and reads every segment with the prime-rl reader in a subprocess."""

    def __init__(self, inner: Receiver, cwd: Path) -> None:
        self.inner = inner
        self.cwd = cwd
        self.checked: list[tuple[list[MicroBatch], list[list[Any]]]] = []  # rows: JSON

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def next_step(self) -> int:
        return self.inner.next_step

    async def receive(self) -> ReceivedPayload:
        got = await self.inner.receive()
        mbs = decode(bytes(got.data), source=got.source)
        files = payload_files(mbs)
        assert files
        assert all(os.path.isabs(f) for f in files), "segment paths are absolute"
        assert all(map(os.path.exists, files)), "payload files exist until their step is consumed"
        segments = [
            {"field": s.field, "file": s.file, "offset": s.offset, "rows": s.rows,
             "dtype": s.dtype, "shape": list(s.shape)}
            for mb in mbs for s in mb.payload or []
        ]  # fmt: skip
        with trio.fail_after(60):
            proc = await trio.run_process(
                [sys.executable, "-c", PRIME_RL_READER],
                stdin=json.dumps(segments).encode(),
                capture_stdout=True,
                cwd=self.cwd,
            )
        result = json.loads(proc.stdout)
        assert Path(result["cwd"]) == self.cwd
        self.checked.append((mbs, result["rows"]))
        return got

    async def ack(self, step: int) -> None:
        await self.inner.ack(step)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_shipped_payloads_read_by_prime_rl_reader_and_batch_receiver(
    tmp_path: Path,
) -> None:
    # The store is given a *relative* root from the test's cwd; the reader runs elsewhere.
    work, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    os.chdir(work)
    try:
        await _run(work, elsewhere)
    finally:
        os.chdir(tmp_path)


async def _run(work: Path, elsewhere: Path) -> None:
    store = PayloadStore("payloads")
    engine = SimulatedEngine(distribution="long-cot", slots=16, seed=3, seconds_per_token=1e-7)
    inner = engine_generate(engine, SamplingParams(max_tokens=32))

    async def generate(sample: Sample) -> None:
        await inner(sample)
        tokens = list(sample.completion_tokens)
        start = len(sample.prompt_tokens)
        routed = np.array([[t, i] for i, t in enumerate(tokens)], dtype=np.int32).reshape(-1, 2)
        mask = [_mask_row(t, i) for i, t in enumerate(tokens)]
        version = sample.policy_versions[-1]
        segments = await trio.to_thread.run_sync(
            lambda: store.write_request(
                version, {"routed_experts": routed}, ragged={"sampling_mask": mask}, pos=start
            )
        )
        sample.payload = tuple(segments)

    steps = 3
    config = OrchestratorConfig(
        batch_groups=2,
        group_size=G,
        max_async_level=1000,
        sink=SinkConfig(batch_size=2 * G, max_off_policy_steps=None),
        sampling=SamplingParams(max_tokens=32),
        seed=11,
    )
    tensors_seen = 0
    async with (
        MemorySender(1) as sender,
        open_orchestrator(
            engine,
            InMemorySource([Prompt(key=f"k{i}", tokens=(i, i + 1, 7)) for i in range(40)]),
            sender,
            config=config,
            sample_reward=_reward,
            generate=generate,
            payloads=store,
        ) as orch,
    ):
        tap = _Tap(sender.receiver(0, start_step=1), elsewhere)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(orch.run, steps)
            async with BatchReceiver(tap) as receiver:
                for _ in range(steps):
                    with trio.fail_after(60):
                        step, tensors = await receiver.receive_tensors()
                    mbs, prime_rows = tap.checked[-1]
                    gone = not any(map(os.path.exists, payload_files(mbs)))
                    assert gone, f"step {step}: consumed payload files are deleted"
                    it = iter(prime_rows)
                    for mb, t in zip(mbs, tensors, strict=True):
                        ids = list(mb.input_ids)
                        routed = t.payload["routed_experts"].numpy()
                        mask = t.payload["sampling_mask"].numpy()
                        assert routed.shape == (len(ids), 2)
                        # labels window: row j is position j + 1
                        assert mask.shape[0] == len(ids) - 1
                        for seg in mb.payload or []:
                            rows = next(it)
                            span = range(seg.pos, seg.pos + seg.rows)
                            if seg.field == "routed_experts":
                                assert rows == routed[seg.pos : seg.pos + seg.rows].tolist()
                                assert [r[0] for r in rows] == [ids[q] for q in span]
                            else:
                                for q, row in zip(span, rows, strict=True):
                                    assert row
                                    assert set(row) == {ids[q]}
                                    if q >= 1:
                                        got = mask[q - 1]
                                        assert got[: len(row)].tolist() == row
                                        assert (got[len(row) :] == -1).all()
                        tensors_seen += 1
            nursery.cancel_scope.cancel()
    assert tensors_seen > 0
    assert len(tap.checked) == steps
