"""The train layer: scoring, the train sink, checkpoint and resume (by-handle payloads are in
:mod:`trio_rl.payloads`)."""

from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import CheckpointManager as CheckpointManager
from ._checkpoint import CheckpointSnapshot as CheckpointSnapshot
from ._checkpoint import IncrementalSnapshot as IncrementalSnapshot
from ._checkpoint import decode_checkpoint as decode_checkpoint
from ._checkpoint import encode_checkpoint as encode_checkpoint
from ._checkpoint import read_checkpoint as read_checkpoint
from ._checkpoint import write_checkpoint as write_checkpoint
from ._errors import CheckpointError as CheckpointError
from ._errors import CodecError as CodecError
from ._errors import PayloadError as PayloadError
from ._errors import PayloadFileMissing as PayloadFileMissing
from ._errors import PayloadFileMissingError as PayloadFileMissingError
from ._errors import TrainError as TrainError
from ._errors import TrainSinkError as TrainSinkError
from ._queue import Cut as Cut
from ._queue import DetachedBatch as DetachedBatch
from ._queue import PruneMode as PruneMode
from ._queue import SinkConfig as SinkConfig
from ._queue import SinkCounters as SinkCounters
from ._queue import SinkWindow as SinkWindow
from ._queue import TrainBatch as TrainBatch
from ._scoring import PruneResult as PruneResult
from ._scoring import ScoringConfig as ScoringConfig
from ._scoring import SequenceLists as SequenceLists
from ._scoring import build_sequences as build_sequences
from ._scoring import grpo_advantages as grpo_advantages
from ._scoring import prune_detached as prune_detached
from ._scoring import prune_zero_advantages as prune_zero_advantages
from ._scoring import to_training_sample as to_training_sample
from ._sink import TrainSink as TrainSink
from ._sink_state import RestoreReport as RestoreReport
from ._sink_state import SinkState as SinkState
from ._sink_state import copy_sample as copy_sample
from ._types import TrainingSample as TrainingSample
