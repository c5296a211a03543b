"""trio-rl: rollout orchestration for asynchronous RL on language models, on trio.

The public facade: it re-exports the API of every layer and defines nothing. The layers follow
the data flow, and each is importable on its own:

* :mod:`trio_rl.samples` and :mod:`trio_rl.wire`: values and the byte-exact wire format;
* :mod:`trio_rl.payloads`: by-handle payload files (written by rollout, read by the trainer);
* :mod:`trio_rl.errors`: every exception, in one tree under :class:`TrioRLError`;
* :mod:`trio_rl.engines`: the ``Engine`` protocol, the simulated and OpenAI-compatible engines;
* :mod:`trio_rl.rollout`: data sources, credit scheduling, group nurseries, drivers;
* :mod:`trio_rl.envs`: multi-turn episodes: environments, tools, the episode runner;
* :mod:`trio_rl.sink`: scoring, the train sink, checkpoint and resume;
* :mod:`trio_rl.publish`: packing and the publisher that finalizes batches off the loop;
* :mod:`trio_rl.transport`: filesystem and ZeroMQ batch transports;
* :mod:`trio_rl.trainer`: the trainer-side ``BatchReceiver`` and torch conversion;
* :mod:`trio_rl.orchestrator`: all of it wired together;
* :mod:`trio_rl.testing`: the Hypothesis harness for credit conservation.
"""

# Uses `from x import y as y` so that type checkers treat these as re-exports.
from .engines import Completion as Completion
from .engines import Engine as Engine
from .engines import GenerateRequest as GenerateRequest
from .engines import OpenAICompatibleEngine as OpenAICompatibleEngine
from .engines import SamplingParams as SamplingParams
from .engines import SimulatedEngine as SimulatedEngine
from .envs import Episode as Episode
from .envs import EpisodeRunner as EpisodeRunner
from .envs import ToolEnv as ToolEnv
from .errors import CheckpointError as CheckpointError
from .errors import DataSourceError as DataSourceError
from .errors import DriverFailedError as DriverFailedError
from .errors import EndOfStreamError as EndOfStreamError
from .errors import EngineError as EngineError
from .errors import EnvError as EnvError
from .errors import PackingError as PackingError
from .errors import PayloadError as PayloadError
from .errors import PublishError as PublishError
from .errors import RolloutError as RolloutError
from .errors import SourceExhaustedError as SourceExhaustedError
from .errors import TensorConversionError as TensorConversionError
from .errors import TrainSinkError as TrainSinkError
from .errors import TransportError as TransportError
from .errors import TransportIOError as TransportIOError
from .errors import TransportTimeoutError as TransportTimeoutError
from .errors import TrioRLError as TrioRLError
from .errors import WireEncodeError as WireEncodeError
from .errors import WireFormatError as WireFormatError
from .orchestrator import Orchestrator as Orchestrator
from .orchestrator import OrchestratorConfig as OrchestratorConfig
from .orchestrator import RunSummary as RunSummary
from .orchestrator import open_orchestrator as open_orchestrator
from .payloads import PayloadStore as PayloadStore
from .publish import Publisher as Publisher
from .publish import Shipment as Shipment
from .publish import ShipRecord as ShipRecord
from .publish import open_publisher as open_publisher
from .publish import pack_samples as pack_samples
from .rollout import AsyncRolloutDriver as AsyncRolloutDriver
from .rollout import DataSource as DataSource
from .rollout import FailurePolicy as FailurePolicy
from .rollout import GroupFactory as GroupFactory
from .rollout import GroupFailedError as GroupFailedError
from .rollout import GroupGranularity as GroupGranularity
from .rollout import GroupRunner as GroupRunner
from .rollout import InMemorySource as InMemorySource
from .rollout import JsonlSource as JsonlSource
from .rollout import SampleBackfill as SampleBackfill
from .rollout import SubmissionPolicy as SubmissionPolicy
from .rollout import SyncRolloutDriver as SyncRolloutDriver
from .rollout import engine_generate as engine_generate
from .rollout import open_async_rollout as open_async_rollout
from .rollout import run_group as run_group
from .samples import Group as Group
from .samples import PolicyVersion as PolicyVersion
from .samples import Prompt as Prompt
from .samples import Sample as Sample
from .samples import SampleStatus as SampleStatus
from .samples import new_group_id as new_group_id
from .sink import CheckpointManager as CheckpointManager
from .sink import PruneMode as PruneMode
from .sink import ScoringConfig as ScoringConfig
from .sink import SinkConfig as SinkConfig
from .sink import TrainBatch as TrainBatch
from .sink import TrainingSample as TrainingSample
from .sink import TrainSink as TrainSink
from .trainer import BatchReceiver as BatchReceiver
from .trainer import TrainerTensors as TrainerTensors
from .trainer import to_torch as to_torch
from .transport import FileReceiver as FileReceiver
from .transport import FileSender as FileSender
from .transport import ZmqReceiver as ZmqReceiver
from .transport import ZmqSender as ZmqSender
from .wire import MicroBatch as MicroBatch
from .wire import decode as decode
from .wire import encode as encode
from .wire import encode_into as encode_into

__version__ = "0.1.0"
