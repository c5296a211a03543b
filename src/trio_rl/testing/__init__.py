"""The public testing harness: a scripted adversarial engine, a credit recorder, and Hypothesis
properties that check the credit invariants listed in docs/testing.md against the library's own
policies, group runner and drivers, or against yours.

Needs ``hypothesis`` (a test dependency; ``trio_rl`` itself never imports this package).
"""

from ._engine import Call as Call
from ._engine import Fate as Fate
from ._engine import FateKind as FateKind
from ._engine import ScriptedEngine as ScriptedEngine
from ._episodes import TOOL_FATES as TOOL_FATES
from ._episodes import TOOL_TIMEOUT as TOOL_TIMEOUT
from ._episodes import EpisodeHarness as EpisodeHarness
from ._episodes import episode_property as episode_property
from ._errors import Invariant as Invariant
from ._errors import InvariantViolationError as InvariantViolationError
from ._errors import ScriptedEngineError as ScriptedEngineError
from ._machine_async import AsyncDriverMachine as AsyncDriverMachine
from ._machine_async import async_driver_machine as async_driver_machine
from ._machine_async import async_driver_test as async_driver_test
from ._machine_credit import CreditProtocolMachine as CreditProtocolMachine
from ._machine_credit import credit_protocol_machine as credit_protocol_machine
from ._machine_credit import credit_protocol_test as credit_protocol_test
from ._machine_sync import SyncDriverMachine as SyncDriverMachine
from ._machine_sync import sync_driver_machine as sync_driver_machine
from ._machine_sync import sync_driver_test as sync_driver_test
from ._properties import async_driver_property as async_driver_property
from ._properties import check_async_driver as check_async_driver
from ._properties import check_credit_loop as check_credit_loop
from ._properties import check_sync_driver as check_sync_driver
from ._properties import credit_loop_property as credit_loop_property
from ._properties import sync_driver_property as sync_driver_property
from ._recorder import CreditRecorder as CreditRecorder
from ._recorder import GroupRecord as GroupRecord
from ._recorder import RecordingPolicy as RecordingPolicy
from ._recorder import RecordingRunner as RecordingRunner
from ._recorder import RunnerLike as RunnerLike
from ._recorder import SampleRecord as SampleRecord
from ._recorder import TrackingLedger as TrackingLedger
from ._report import Trace as Trace
from ._report import live_tasks as live_tasks
from ._strategies import ADVANCE_SECONDS as ADVANCE_SECONDS
from ._strategies import DELAYS as DELAYS
from ._strategies import Step as Step
from ._strategies import schedules as schedules
from ._strategies import steps as steps
from ._subject import HANG_TIMEOUT as HANG_TIMEOUT
from ._subject import PolicyFactory as PolicyFactory
from ._subject import RolloutSubject as RolloutSubject
from ._subject import default_generate as default_generate
