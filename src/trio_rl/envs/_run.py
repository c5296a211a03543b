"""`EpisodeRunner`: an environment function as the group runner's generate function.

One sample is one episode, so one credit is one episode: the group nursery, credit
conservation and exactly-once delivery are those of single-turn samples.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import math
import os
import sys
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from ..engines import Engine, EngineError, SamplingParams
from ..errors import EnvConfigError, EpisodeStoppedError, TemplateMismatchError, collapse_single
from ..samples import Sample, SampleStatus
from ._chat import ChatTemplate
from ._config import EnvConfig, StopReason
from ._deadlines import Deadlines
from ._episode import Codec, Episode, _AbortedEpisodeError
from ._stats import EpisodeStats

__all__ = ["EnvFn", "EpisodeRunner", "RecordRewardFn", "import_env", "single_turn"]

logger = logging.getLogger("trio_rl.envs")

#: An environment: ``async fn(episode, record) -> reward``.
EnvFn = Callable[[Episode, Mapping[str, Any]], Awaitable[float]]
#: ``fn(record, completion) -> float``, plain or async.
RecordRewardFn = Callable[[Mapping[str, Any], str], float | Awaitable[float]]

_NO_DEADLINE: contextlib.nullcontext[None] = contextlib.nullcontext()

#: The key of ``Sample.metadata`` holding an episode's summary: ``turns``, ``stop`` (its stop
#: reason) and ``spans`` (``[start, end, policy version]`` of each turn in the completion, so
#: every sampled token's version is known).
EPISODE_KEY = "episode"

# how the sample ends for each stop reason: a finished episode trains; one whose tool or
# environment failed is failed (counted by the sink, its group trains on the rest)
_STATUS: dict[str, SampleStatus] = {
    "done": SampleStatus.COMPLETED,
    "max_turns": SampleStatus.TRUNCATED,
    "budget": SampleStatus.TRUNCATED,
    "episode_timeout": SampleStatus.TRUNCATED,
    "tool_timeout": SampleStatus.FAILED,
    "error": SampleStatus.FAILED,
}


def single_turn(reward: RecordRewardFn) -> EnvFn:
    """The one-turn environment of a record reward: one ``generate()``, scored by
    ``reward(record, text)`` (plain functions run in a worker thread under the run's limiter)."""
    is_async = inspect.iscoroutinefunction(reward)

    async def play(episode: Episode, record: Mapping[str, Any]) -> float:
        text = await episode.generate()
        if is_async:
            return float(await reward(record, text))  # type: ignore[misc]
        value: Any = await episode.run_sync(reward, record, text)
        return float(value)

    return play


def import_env(spec: str) -> EnvFn:
    """The environment ``"package.module:name"`` names (imported from the working directory or
    ``sys.path``); :class:`~trio_rl.errors.EnvConfigError` naming it when it cannot be
    imported or is not callable."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise EnvConfigError(f'[env] function {spec!r}: expected "package.module:name"')
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise EnvConfigError(
            f"[env] function {spec!r}: cannot import module {module_name!r}: {detail}"
        ) from exc
    finally:
        if added:
            sys.path.remove(cwd)
    for part in name.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise EnvConfigError(
                f"[env] function {spec!r}: module {module_name!r} has no {name!r}"
            ) from None
    if not callable(found):
        raise EnvConfigError(f"[env] function {spec!r}: {name!r} is not callable")
    env: EnvFn = found
    return env


@attrs.define(slots=True, eq=False)
class EpisodeRunner:
    """Plays ``env`` for each sample: a generate function for the group runner
    (``open_orchestrator(generate=runner)``).

    ``params`` are the sampling settings of every turn (``max_tokens`` caps one turn);
    ``max_len`` the episode's token budget, prompt included (the run's ``seq_len`` and the
    model's context); ``codec`` turns text to tokens and back; ``chat`` is the chat template of
    a chat model (for :meth:`Episode.observe_message` and the template check); ``limiter`` the
    run's capacity limiter (sync tools and rewards run under it).

    The episode runs under ``config.episode_timeout``; it ends with exactly one stop reason,
    counted in ``stats``, recorded in ``sample.metadata["episode"]``: a normal return is
    ``done`` (COMPLETED, the returned reward); ``max_turns``, ``budget``, ``episode_timeout``
    end it TRUNCATED with reward 0 (or the reward passed to :meth:`Episode.stop`), trained;
    ``tool_timeout`` and ``error`` (the environment raised) end it FAILED: not trained, the
    sink counts it and its group trains on the rest. An engine that fails a turn past
    ``config.turn_retries`` fails the group, as for a single-turn sample. An episode given up
    by a soft stop (finish reason ``abort``) is ABORTED and regenerated from its prompt,
    never continued.
    """

    engine: Engine
    env: EnvFn
    codec: Codec
    params: SamplingParams = attrs.field(factory=SamplingParams)
    config: EnvConfig = attrs.field(factory=EnvConfig)
    max_len: int = 8192
    chat: ChatTemplate | None = None
    limiter: trio.CapacityLimiter | None = None
    stats: EpisodeStats = attrs.field(factory=EpisodeStats)
    #: The first few errors are logged with their traceback, then only counted.
    log_first: int = 3
    _prefix: str = attrs.field(init=False, factory=lambda: uuid.uuid4().hex[:12])
    _logged: int = attrs.field(init=False, default=0)
    #: while open: the deadline server of its episodes and tool calls, and what closes it
    _deadlines: Deadlines | None = attrs.field(init=False, default=None)
    _serving: contextlib.AsyncExitStack | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.max_len < 1:
            raise EnvConfigError(f"EpisodeRunner.max_len must be >= 1, got {self.max_len}")

    async def __aenter__(self) -> EpisodeRunner:
        """Start the task that serves the deadlines of every episode and tool call (a dict
        insert and delete each, instead of an entry in trio's deadline heap that outlives the
        scope: see ``envs/_deadlines.py``). Unopened, the runner works the same, each scope
        with a deadline of its own."""
        if self._serving is not None:
            raise EnvConfigError("EpisodeRunner: already open (one `async with` at a time)")
        stack = contextlib.AsyncExitStack()
        # a failure of the block comes out as itself, not in the nursery's exception group
        stack.enter_context(collapse_single())
        nursery = await stack.enter_async_context(trio.open_nursery())
        deadlines = Deadlines()
        stack.callback(nursery.cancel_scope.cancel)  # the server runs until the runner closes
        await nursery.start(deadlines.serve, name="trio_rl.envs.deadlines")
        self._serving, self._deadlines = stack, deadlines
        return self

    async def __aexit__(self, *exc_info: Any) -> bool:
        """Stop the deadline server (cancelled; it holds nothing). An episode still playing
        then keeps its deadlines in trio's own heap, as an unopened runner's do. A failure of
        the block passes through the server's nursery (which a cancellation of its own ends
        in) and comes out as itself."""
        stack = self._serving
        self._serving, self._deadlines = None, None
        if stack is None:
            return False
        return bool(await stack.__aexit__(*exc_info))

    async def __call__(self, sample: Sample) -> None:
        episode = self._episode(sample)
        timeout = self.config.episode_timeout
        # no deadline, no cancel scope: an unbounded one cost ~1.2 us a turn (5 us an episode)
        # in bench_episodes
        deadline: contextlib.AbstractContextManager[trio.CancelScope | None] = (
            _NO_DEADLINE if timeout is None else episode.cancel_after(timeout)
        )
        reason: StopReason = "done"
        reward = 0.0
        drop = False  # the episode's tokens are not trained
        with deadline as scope:
            try:
                # awaited here, not in a coroutine of its own: every coroutine between the
                # task and the engine is resumed at each of the episode's waits (bench_episodes
                # at 10,000 episodes, with the first turn's request: 4 % fewer young
                # collections, one full collection fewer a run)
                value = await self.env(episode, episode.record)
                reward = float(value)
                if not math.isfinite(reward):
                    raise ValueError(f"the environment returned {value!r}, not a finite reward")
            except EpisodeStoppedError:
                reason = episode.stop_reason or "error"
                reward = episode.stop_reward
            except _AbortedEpisodeError:
                # given up by a soft stop: ABORTED, to regenerate
                sample.status = SampleStatus.ABORTED
                self.stats.aborted += 1
                return
            except EngineError:
                raise  # the engine gave up on the turn: the group fails, as a sample would
            except TemplateMismatchError:
                self.stats.mismatches += 1
                if self.config.on_mismatch == "fail":
                    raise
                reason, drop = "error", True
            except Exception as exc:
                reason = "error"
                self._log(sample, exc)
            else:
                if episode.stop_reason is not None:  # the environment swallowed its stop
                    reason, reward = episode.stop_reason, episode.stop_reward
        if scope is not None and scope.cancelled_caught:
            reason, reward = "episode_timeout", 0.0
        self._finish(sample, episode, reason, reward)
        if drop:
            sample.loss_mask = [False] * len(sample.loss_mask)

    def _episode(self, sample: Sample) -> Episode:
        if sample.completion_tokens:
            # an aborted episode is regenerated from its prompt: its turns were answers to
            # observations of a policy that is gone, and a continuation would mix them
            sample.reset_for_retry()
        record = sample.label if isinstance(sample.label, Mapping) else {}
        return Episode(
            record,
            sample,
            self.engine,
            self.params,
            self.codec,
            self.config,
            self.max_len,
            limiter=self.limiter,
            chat=self.chat,
            stats=self.stats,
            deadlines=self._deadlines,
            request_prefix=self._prefix,
        )

    def _finish(self, sample: Sample, episode: Episode, reason: StopReason, reward: float) -> None:
        if _STATUS[reason] is not SampleStatus.COMPLETED:
            reward = reward if reason != "error" else 0.0
        sample.status = _STATUS[reason]
        sample.reward = reward
        sample.metadata[EPISODE_KEY] = {
            "turns": episode.turns,
            "stop": reason,
            "spans": [list(span) for span in episode.spans],
        }
        self.stats.ended(reason)
        chat, messages = self.chat, episode.messages
        checked = reason != "error"  # an episode that failed is not trained anyway
        if (
            checked
            and chat is not None
            and messages is not None
            and not chat.matches(messages, episode.tokens)
        ):
            self.stats.mismatches += 1
            if self.config.on_mismatch == "fail":
                raise TemplateMismatchError(
                    f"sample {sample.index}: the chat template renders the episode's "
                    "conversation differently from the tokens it holds (it rewrites "
                    'earlier turns); [env] on_mismatch = "drop" trains nothing of such '
                    "an episode instead"
                )
            sample.loss_mask = [False] * len(sample.loss_mask)

    def _log(self, sample: Sample, exc: Exception) -> None:
        self._logged += 1
        if self._logged <= self.log_first:
            logger.warning(
                "the environment failed episode %d (%s: %s); the episode ends as error, the "
                "run goes on%s",
                sample.index,
                type(exc).__name__,
                " ".join(str(exc).split()) or "(no message)",
                "; further errors are only counted" if self._logged == self.log_first else "",
                exc_info=exc,
            )
