"""Transports by name: a fourth transport, registered here, carries ``trio-rl simulate``.

Nothing in the command knows the transport: it is one class and one registration, looked up by
its ``[transport] kind``, and the run's trainer ranks receive every step through it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import pytest

from trio_rl import cli
from trio_rl.errors import InvalidArgumentError
from trio_rl.transport import (
    MemorySender,
    Payload,
    TransportKind,
    register_transport,
    transport_kind,
    transport_kinds,
    unregister_transport,
)


class _CountingSender(MemorySender):
    """The in-memory transport, counting what it delivers (per step: its payload sizes)."""

    delivered: ClassVar[dict[int, list[int]]] = {}

    async def send(self, step: int, payloads: Sequence[Payload]) -> None:
        await super().send(step, payloads)
        self.delivered[step] = [len(memoryview(p)) for p in payloads]


@pytest.fixture
def fourth() -> Iterator[type[_CountingSender]]:
    _CountingSender.delivered = {}
    register_transport(
        TransportKind(
            "counting",
            sender=lambda setup: _CountingSender(setup.ranks),
            receiver=lambda setup, sender, rank, start: sender.receiver(rank, start_step=start),  # type: ignore[attr-defined]
            describe=lambda setup: "the counting channels",
        )
    )
    try:
        yield _CountingSender
    finally:
        unregister_transport("counting")


def test_the_built_in_transports_are_registered_like_any_other() -> None:
    assert {"files", "zmq", "memory"} <= set(transport_kinds())
    with pytest.raises(InvalidArgumentError, match=r"no transport 'carrier-pigeon'.*files"):
        transport_kind("carrier-pigeon")


def test_simulate_runs_through_a_transport_registered_in_the_test(
    fourth: type[_CountingSender], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["simulate", "--out", str(out), "--steps", "3", "--ranks", "2", "--transport"]
    sizes = ["--batch-groups", "2", "--group-size", "2", "--max-tokens", "16"]
    assert cli.main([*argv, "counting", *sizes]) == 0
    printed = capsys.readouterr().out
    assert "batches via the counting channels" in printed
    # every step went through the registered sender, one payload per rank
    assert sorted(fourth.delivered) == [1, 2, 3]
    assert all(len(p) == 2 and min(p) > 0 for p in fourth.delivered.values())
    # and each trainer rank trained every step it sent, once
    for rank in range(2):
        lines = (out / "trainer" / f"rank_{rank}.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    # no batch file: the files transport was not used
    assert not (out / "batches").exists()


def test_an_unknown_transport_is_a_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["simulate", "--set", "transport.kind=carrier-pigeon", "--steps", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "transport.kind" in err
    assert "no transport 'carrier-pigeon' is registered; known: files, memory, zmq" in err
