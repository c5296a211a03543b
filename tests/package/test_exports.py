"""The public surface: facades re-export, and the package imports without its optional extras."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import trio_rl

FACADES = [
    "trio_rl",
    "trio_rl.samples",
    "trio_rl.wire",
    "trio_rl.engines",
    "trio_rl.rollout",
    "trio_rl.train",
    "trio_rl.publish",
    "trio_rl.transport",
    "trio_rl.trainer",
    "trio_rl.testing",
    "trio_rl.orchestrator",
    "trio_rl.learn",  # imports torch (the optional extra); nothing else imports it
]


@pytest.mark.parametrize("name", FACADES)
def test_every_public_name_resolves_and_is_documented(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no module docstring"
    public = [n for n in vars(module) if not n.startswith("_")]
    assert public, f"{name} exports nothing"
    for n in public:
        assert getattr(module, n) is not None


def test_the_top_level_facade_defines_nothing_itself() -> None:
    defined_here = [
        n
        for n, v in vars(trio_rl).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == "trio_rl"
    ]
    assert defined_here == []


def test_importing_the_library_does_not_import_torch() -> None:
    code = "import sys, trio_rl, trio_rl.trainer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_transport_facade_exports_one_sender_and_one_receiver_per_transport() -> None:
    import trio_rl.transport as transport

    public = {n for n in vars(transport) if not n.startswith("_")}
    assert public == {
        "Sender",
        "Receiver",
        "Payload",
        "ReceivedPayload",
        "FileSender",
        "FileReceiver",
        "ZmqSender",
        "ZmqReceiver",
        "MemorySender",
        "MemoryReceiver",
        "ZmqSocket",
        "batch_path",
        "rank_topic",
        "free_port_pair",
        "TransportError",
        "TransportIOError",
        "TransportTimeoutError",
        "EndOfStream",
        "EndOfStreamError",
    }
    for sender in (transport.FileSender, transport.ZmqSender, transport.MemorySender):
        assert issubclass(sender, transport.Sender)
    for receiver in (transport.FileReceiver, transport.ZmqReceiver, transport.MemoryReceiver):
        assert issubclass(receiver, transport.Receiver)
