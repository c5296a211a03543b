"""Batch transports: filesystem and ZeroMQ senders/receivers, and the trio glue for pyzmq.

A transport moves one opaque payload per (step, rank); decoding is the trainer's business.
"""

from ._base import BatchSender as BatchSender
from ._base import Payload as Payload
from ._base import ReceivedPayload as ReceivedPayload
from ._base import ReceiverTransport as ReceiverTransport
from ._errors import EndOfStream as EndOfStream
from ._errors import TransportError as TransportError
from ._errors import TransportIOError as TransportIOError
from ._errors import TransportTimeoutError as TransportTimeoutError
from ._files import FileBatchReceiver as FileBatchReceiver
from ._files import FileBatchSender as FileBatchSender
from ._files import batch_path as batch_path
from ._files import consumed_marker_path as consumed_marker_path
from ._files import end_marker_path as end_marker_path
from ._zmq import ZmqSocket as ZmqSocket
from ._zmq_transport import ZmqBatchReceiver as ZmqBatchReceiver
from ._zmq_transport import ZmqBatchSender as ZmqBatchSender
from ._zmq_transport import end_topic as end_topic
from ._zmq_transport import free_port_pair as free_port_pair
from ._zmq_transport import rank_topic as rank_topic
