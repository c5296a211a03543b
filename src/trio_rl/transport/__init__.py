"""Batch transports: a `Sender` and a `Receiver` per transport (files, ZeroMQ, memory).

A transport moves one opaque payload per (step, rank); decoding is the trainer's business
(`trio_rl.trainer.BatchReceiver` wraps a `Receiver`).

- `FileSender` / `FileReceiver`: ``<dir>/batches/step_<S>/rank_<R>.bin``, one file each.
- `ZmqSender` / `ZmqReceiver`: ZeroMQ PUB/SUB with a READY barrier.
- `MemorySender` / `MemoryReceiver`: trio memory channels, for tests and single-process runs.

Each registers by name (`register_transport`, `transport_kind`): a command looks its
``[transport] kind`` up there, and a new transport is one module plus one registration.
"""

from ._base import Payload as Payload
from ._base import ReceivedPayload as ReceivedPayload
from ._base import Receiver as Receiver
from ._base import Sender as Sender
from ._base import StagingSender as StagingSender
from ._errors import EndOfStreamError as EndOfStreamError
from ._errors import TransportError as TransportError
from ._errors import TransportIOError as TransportIOError
from ._errors import TransportTimeoutError as TransportTimeoutError
from ._file_layout import CONSUMED_FILE as CONSUMED_FILE
from ._file_layout import RANK_FILE as RANK_FILE
from ._file_layout import STEP_DIR as STEP_DIR
from ._files import FileReceiver as FileReceiver
from ._files import FileSender as FileSender
from ._files import batch_path as batch_path
from ._files import batches_dir as batches_dir
from ._files import consumed_dir as consumed_dir
from ._files import end_marker_path as end_marker_path
from ._files import held_steps as held_steps
from ._memory import MemoryReceiver as MemoryReceiver
from ._memory import MemorySender as MemorySender
from ._registry import TransportKind as TransportKind
from ._registry import TransportSetup as TransportSetup
from ._registry import register_transport as register_transport
from ._registry import transport_kind as transport_kind
from ._registry import transport_kinds as transport_kinds
from ._registry import unregister_transport as unregister_transport
from ._zmq import ZmqSocket as ZmqSocket
from ._zmq_transport import ZmqReceiver as ZmqReceiver
from ._zmq_transport import ZmqSender as ZmqSender
from ._zmq_transport import free_port_pair as free_port_pair
from ._zmq_transport import rank_topic as rank_topic
from ._zmq_transport import step_topic as step_topic
