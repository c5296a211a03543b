"""Environments: multi-turn episodes, the policy and an environment taking turns.

An environment is a function ``async def play(episode, record) -> float``: it drives the
policy through :class:`Episode` (``await episode.generate()``, ``episode.observe(text)``,
``episode.observe_message(role, content)``) and returns the episode's reward.
:class:`ToolEnv` is one where the policy calls tools. :class:`EpisodeRunner` plays an
environment for each sample of a run: one sample is one episode, its exact token sequence,
with the loss mask True exactly on the sampled tokens.
"""

from ..errors import EnvConfigError as EnvConfigError
from ..errors import EnvError as EnvError
from ..errors import EpisodeStoppedError as EpisodeStoppedError
from ..errors import TemplateMismatchError as TemplateMismatchError
from ..errors import ToolCallSyntaxError as ToolCallSyntaxError
from ._chat import ChatTemplate as ChatTemplate
from ._chat import Message as Message
from ._config import STOP_REASONS as STOP_REASONS
from ._config import EnvConfig as EnvConfig
from ._config import MismatchPolicy as MismatchPolicy
from ._config import StopReason as StopReason
from ._episode import Codec as Codec
from ._episode import Episode as Episode
from ._run import EPISODE_KEY as EPISODE_KEY
from ._run import EnvFn as EnvFn
from ._run import EpisodeRunner as EpisodeRunner
from ._run import RecordRewardFn as RecordRewardFn
from ._run import import_env as import_env
from ._run import single_turn as single_turn
from ._stats import EpisodeStats as EpisodeStats
from ._tools import CallSyntax as CallSyntax
from ._tools import CompactCalls as CompactCalls
from ._tools import HermesCalls as HermesCalls
from ._tools import ToolCall as ToolCall
from ._tools import ToolEnv as ToolEnv
from ._tools import ToolRewardFn as ToolRewardFn
