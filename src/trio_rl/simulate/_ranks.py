"""``trio-rl simulate``'s trainer ranks: each reads its payload of every step through the run's
transport, turns it into torch tensors when torch is installed, records what it trained and
reports the step (`Trained` advances the policy version once every rank has trained it).

A rank is resumable over any transport: its own log (``trainer/rank_<R>.jsonl``) is the truth
of what it trained, so a step is trained exactly once even when the process is killed between
reading and recording (`start_step` says where a restarted rank begins).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from ..orchestrator import Orchestrator
from ..rundir import RunDirectory
from ..trainer import to_torch
from ..transport import EndOfStreamError, Receiver, TransportKind, TransportSetup
from ..wire import MicroBatch, decode


async def trainer_rank(
    receiver: Receiver, out: Path, start: int, stop: int, on_step: Trained
) -> None:
    """One trainer rank, resumable, over any transport: read step after step, train, append
    one fsynced line to ``trainer/rank_<R>.jsonl`` and only then acknowledge the step (a
    transport that keeps payloads until then, the file one, deletes it). A restart continues
    after the last recorded step, so a step is trained exactly once even when the process is
    killed between reading and recording."""
    rank = receiver.rank
    log = RunDirectory(out).trainer_log(rank)
    log.parent.mkdir(parents=True, exist_ok=True)
    async with receiver:
        for step in range(start, stop):
            try:
                got = await receiver.receive()
            except EndOfStreamError:
                return  # the run ended early (its source ran dry)
            data = bytes(got.data)
            micro_batches = await trio.to_thread.run_sync(decode, data)
            tokens, loss = _train(micro_batches)
            line = json.dumps({"step": step, "rank": rank, **_record(micro_batches, data)})
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_append, log, line)
                await receiver.ack(step)
            on_step.add(step, rank, tokens, loss)


def _train(micro_batches: Sequence[MicroBatch]) -> tuple[int, float]:
    tensorize = "torch" in sys.modules  # imported up front by main(), when installed
    tokens, loss = 0, 0.0
    for mb in micro_batches:
        tokens += len(mb.input_ids)
        if tensorize:
            t = to_torch(mb)
            loss += float((t.advantages * t.loss_mask).sum())
    return tokens, loss


def trained_through(out: Path, rank: int) -> int | None:
    """The last step trainer rank ``rank`` recorded as trained (its own durable progress)."""
    try:
        lines = RunDirectory(out).trainer_log(rank).read_text().splitlines()
    except FileNotFoundError:
        return None
    last = None
    for line in lines:
        try:
            last = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            break  # a line torn by a crash: the step after it was not recorded
    return last


def _record(micro_batches: Sequence[MicroBatch], data: bytes) -> dict[str, object]:
    # What the trainer trained on, for checking exactly-once from its side: the payload's hash
    # and, per sequence, its prompt tokens and a fingerprint of its tokens and logprobs (two
    # samples of one prompt may decode the same tokens; their logprobs tell them apart).
    seqs = []
    for mb in micro_batches:
        pos = 0
        for length in mb.sequence_lengths:
            end = pos + length
            ids, mask = mb.input_ids[pos:end], mb.loss_mask[pos:end]
            logprobs = mb.inference_logprobs[pos:end]
            pos = end
            if any(mask):  # padding-only sequences train nothing
                digest = hashlib.sha1(repr((ids, mask, logprobs)).encode()).hexdigest()[:16]
                seqs.append([*ids[:3], digest])
    return {"sha256": hashlib.sha256(data).hexdigest(), "seqs": seqs}


def _append(log: Path, line: str) -> None:
    with open(log, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


@attrs.define
class Trained:
    """What the trainer ranks trained, ``(step, rank, tokens, loss)`` rows; the trainer finishing
    step S publishes policy S once every rank has trained step S (in `add`, no polling).

    A resumed trainer rank has trained everything before its start step, so the version
    ``min(start) - 1`` is reported by `start` (the orchestrator's ship gate waits for it)."""

    rows: list[tuple[int, int, int, float]] = attrs.field(factory=list)
    orch: Orchestrator | None = None
    done: list[int] = attrs.field(factory=list)

    def start(self, orch: Orchestrator, starts: list[int]) -> None:
        self.orch = orch
        self.done = [s - 1 for s in starts]
        self._advance()

    def add(self, step: int, rank: int, tokens: int, loss: float) -> None:
        self.rows.append((step, rank, tokens, loss))
        if self.orch is not None:
            self.done[rank] = max(self.done[rank], step)
            self._advance()

    def _advance(self) -> None:
        assert self.orch is not None
        version = min(self.done)
        if version > self.orch.policy_version:
            self.orch.set_policy_version(version)


def start_step(
    kind: TransportKind, setup: TransportSetup, out: Path, rank: int, resent_from: int
) -> int:
    """The step trainer rank ``rank`` starts at. Where payloads outlive the process, the rank's
    own log is the truth, and a rank that logged nothing yet (killed before its first step)
    starts at its oldest payload still held; elsewhere it starts with the first step the
    orchestrator sends (a pending step is re-sent first, identical)."""
    if not kind.durable:
        return resent_from
    through = trained_through(out, rank)
    if through is not None:
        return through + 1
    held = kind.held_from(setup, rank)
    return held if held is not None else resent_from
