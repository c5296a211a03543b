"""Transports by name: ``kind`` -> how to open its sender and its receivers.

A command that ships batches (``trio-rl simulate``) names its transport in the configuration
(``[transport] kind``); it looks the kind up here instead of branching on the name. The three
built-in transports register exactly as a fourth one would::

    register_transport(TransportKind(
        "mine",
        sender=lambda setup: MySender(setup.ranks),
        receiver=lambda setup, sender, rank, start: sender.receiver(rank, start_step=start),
        describe=lambda setup: "my transport",
    ))

A kind's configuration is the ``[transport]`` section (`TransportSetup` carries it: the run
directory, the rank count, the port, and every key of the section in ``options``); a kind reads
the keys it needs and names them in ``keys``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from ..errors import InvalidArgumentError
from ._base import Receiver, Sender
from ._file_layout import oldest_batch_step
from ._files import FileReceiver, FileSender, end_marker_path
from ._memory import MemorySender
from ._zmq_transport import ZmqReceiver, ZmqSender, free_port_pair


@attrs.frozen
class TransportSetup:
    """What a run gives a transport to open its ends with."""

    #: The run directory (the file transport writes ``batches/`` under it).
    directory: Path
    #: The number of trainer ranks.
    ranks: int
    #: ``[transport] port``: the port a network transport listens on (0: let it pick).
    port: int = 0
    #: Every key of the ``[transport]`` section, for a kind's own options.
    options: Mapping[str, Any] = attrs.field(factory=dict)


def _same(setup: TransportSetup) -> TransportSetup:
    return setup


def _nothing_held(setup: TransportSetup, rank: int) -> int | None:
    return None


@attrs.frozen
class TransportKind:
    """One transport, by name.

    ``sender(setup)`` opens the sender; ``receiver(setup, sender, rank, start_step)`` a rank's
    receiver (an in-process transport hands out receivers from its sender; the others connect
    through the setup); ``describe(setup)`` says where batches go, for a run's first line.
    ``resolve(setup)`` settles what the sender and receivers must agree on before either opens
    (a free port). ``durable``: payloads outlive the process (until a receiver acknowledges
    them), so a restarted trainer rank resumes after the last step it recorded, or at
    ``held_from(setup, rank)``, the oldest step still held for it (None: none).
    """

    name: str
    sender: Callable[[TransportSetup], Sender]
    receiver: Callable[[TransportSetup, Sender, int, int], Receiver]
    describe: Callable[[TransportSetup], str]
    resolve: Callable[[TransportSetup], TransportSetup] = _same
    durable: bool = False
    held_from: Callable[[TransportSetup, int], int | None] = _nothing_held
    #: The ``[transport]`` keys this kind reads besides ``kind``.
    keys: tuple[str, ...] = ()


_KINDS: dict[str, TransportKind] = {}


def register_transport(kind: TransportKind) -> None:
    """Make ``kind`` available by its name (a name registered again is replaced)."""
    _KINDS[kind.name] = kind


def unregister_transport(name: str) -> None:
    """Forget the transport ``name`` (a no-op for an unknown one)."""
    _KINDS.pop(name, None)


def transport_kinds() -> tuple[str, ...]:
    """The names of every registered transport, sorted."""
    return tuple(sorted(_KINDS))


def transport_kind(name: str) -> TransportKind:
    """The transport registered as ``name``; an unknown name is an `InvalidArgumentError`
    listing the known ones."""
    try:
        return _KINDS[name]
    except KeyError:
        known = ", ".join(transport_kinds())
        raise InvalidArgumentError(f"no transport {name!r} is registered; known: {known}") from None


def _oldest_file(setup: TransportSetup, rank: int) -> int | None:
    return oldest_batch_step(setup.directory, rank)


def _zmq_port(setup: TransportSetup) -> TransportSetup:
    return setup if setup.port else attrs.evolve(setup, port=free_port_pair())


def _memory_receiver(setup: TransportSetup, sender: Sender, rank: int, start: int) -> Receiver:
    if not isinstance(sender, MemorySender):
        raise InvalidArgumentError(f"a memory receiver needs a MemorySender, got {sender!r}")
    return sender.receiver(rank, start_step=start)


register_transport(
    TransportKind(
        "files",
        sender=lambda setup: FileSender(setup.directory, setup.ranks),
        # a trainer rank waits on the orchestrator's next step: poll often (at most every
        # 20 ms); a consumed file is deleted once acknowledged
        receiver=lambda setup, _, rank, start: FileReceiver(
            setup.directory, rank, start_step=start, max_poll_interval=0.02, delete=True
        ),
        describe=lambda setup: str(end_marker_path(setup.directory).parent),
        durable=True,
        held_from=_oldest_file,
    )
)
register_transport(
    TransportKind(
        "zmq",
        sender=lambda setup: ZmqSender(setup.ranks, port=setup.port),
        receiver=lambda setup, _, rank, start: ZmqReceiver(rank, port=setup.port, start_step=start),
        describe=lambda setup: f"tcp://127.0.0.1:{setup.port}",
        resolve=_zmq_port,
        keys=("port", "allow_privileged_port"),
    )
)
register_transport(
    TransportKind(
        "memory",
        sender=lambda setup: MemorySender(setup.ranks),
        receiver=_memory_receiver,
        describe=lambda setup: "memory channels (this process)",
    )
)
