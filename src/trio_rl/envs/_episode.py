"""`Episode`: one multi-turn rollout, the policy and an environment taking turns.

The episode's tokens are the sample's: the prompt, then every turn appended as it happens.
Sampled tokens carry loss mask True, their logprobs and their policy version; observed tokens
(tool results, the environment's messages) carry mask False and logprob 0.0. Every engine
request's prompt is the episode's tokens so far, so it is a token prefix of the final sample.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, NoReturn, Protocol, TypeVar

import attrs
import trio

from ..engines import (
    Completion,
    Engine,
    EngineTimeoutError,
    EngineTransportError,
    GenerateRequest,
    SamplingParams,
)
from ..errors import EnvConfigError, EnvError, EpisodeStoppedError
from ..rollout import current_abort
from ..samples import Sample
from ._chat import ChatTemplate
from ._config import STOP_REASONS, EnvConfig, StopReason
from ._deadlines import Deadlines
from ._stats import EpisodeStats

__all__ = ["Codec", "Episode"]

_T = TypeVar("_T")


class Codec(Protocol):
    """Text <-> token ids, as the policy's tokenizer does them."""

    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...


class _AbortedEpisodeError(EnvError):
    """An engine answered a turn with finish reason ``abort`` (a soft stop of the driver):
    the episode is given up and regenerated (never continued)."""


def _turn_seed(seed: int | None, turn: int) -> int | None:
    # the first turn samples with the sample's own seed (a one-turn episode is exactly a
    # single-turn sample); later turns with seeds of their own, fixed by the sample's
    if seed is None or turn == 0:
        return seed
    return (seed * 1_000_003 + turn) % (2**31 - 1)


@attrs.define(slots=True, eq=False)
class Episode:
    """One episode: what an environment function gets to drive the policy.

    ``record`` is the run's record (the JSONL line); ``turns`` counts the policy turns so far.
    :meth:`generate` is one policy turn, :meth:`observe` / :meth:`observe_message` append the
    environment's side, :meth:`stop` ends the episode with a reason. An episode that runs out
    of a budget raises :class:`~trio_rl.errors.EpisodeStoppedError` from the call that would
    exceed it; an environment lets it pass (the runner records the stop reason).

    Made by the runner (:class:`~trio_rl.envs.EpisodeRunner`), not by hand.
    """

    record: Mapping[str, Any]
    sample: Sample
    engine: Engine
    params: SamplingParams
    codec: Codec
    config: EnvConfig
    #: the longest the episode may grow, prompt included (tokens)
    max_len: int
    limiter: trio.CapacityLimiter | None = None
    chat: ChatTemplate | None = None
    stats: EpisodeStats = attrs.field(factory=EpisodeStats)
    #: the runner's deadline server, while it is open (else None: a scope's own deadline)
    deadlines: Deadlines | None = None
    request_prefix: str = ""
    turns: int = 0
    #: set once the episode ended (by a budget, a tool, or :meth:`stop`)
    stop_reason: StopReason | None = None
    #: the reward :meth:`stop` was given (0.0 for the budgets' stops)
    stop_reward: float = 0.0
    #: the finish reason of the last turn (``stop``, ``length``)
    last_finish: str | None = None
    #: the conversation so far, when every part of it is a chat message (for the template check)
    messages: list[dict[str, Any]] | None = None
    #: per policy turn: ``(start, end, policy version)``, positions in the completion
    spans: list[tuple[int, int, int]] = attrs.field(factory=list)
    _open_turn: bool = False  # a message was observed: the next turn opens with the prompt
    _routing_key: str = attrs.field(init=False, default="")

    def __attrs_post_init__(self) -> None:
        key = self.sample.routing_key
        self._routing_key = key if key is not None else f"episode-{self.sample.index}"
        raw = self.record.get("messages")
        if self.chat is not None and isinstance(raw, list):
            self.messages = [dict(m) for m in raw]

    # ---------------------------------------------------------------------------- reading

    @property
    def tokens(self) -> tuple[int, ...]:
        """Every token so far: the prompt, then the turns."""
        return self.sample.prompt_tokens + tuple(self.sample.completion_tokens)

    @property
    def length(self) -> int:
        return len(self.sample.prompt_tokens) + len(self.sample.completion_tokens)

    # ---------------------------------------------------------------------------- stopping

    def stop(self, reason: StopReason = "done", reward: float = 0.0, detail: str = "") -> NoReturn:
        """End the episode now with ``reason`` and ``reward``: raises
        :class:`~trio_rl.errors.EpisodeStoppedError`, which the environment lets pass."""
        if reason not in STOP_REASONS:
            raise EnvConfigError(
                f"Episode.stop: reason must be one of {list(STOP_REASONS)}, got {reason!r}"
            )
        if self.stop_reason is None:
            self.stop_reason, self.stop_reward = reason, reward
        raise EpisodeStoppedError(self.stop_reason, self.stop_reward, detail)

    def _check_open(self) -> None:
        if self.stop_reason is not None:
            raise EpisodeStoppedError(
                self.stop_reason, self.stop_reward, "the episode had ended already"
            )

    # ---------------------------------------------------------------------------- turns

    async def generate(self, max_tokens: int | None = None) -> str:
        """One policy turn: sample from every token so far, append the sampled tokens
        (trainable, with their logprobs and policy version) and return their text.

        ``max_tokens`` caps this turn (default: the run's ``max_tokens``); the episode's token
        budget caps it too. A turn past ``max_turns`` stops the episode (``max_turns``); one
        with no room left, or cut short by the budget, stops it (``budget``) after keeping what
        was sampled.
        """
        self._check_open()
        if max_tokens is not None and max_tokens < 1:
            raise EnvConfigError(f"Episode.generate: max_tokens must be >= 1, got {max_tokens}")
        if self.config.max_turns is not None and self.turns >= self.config.max_turns:
            self.stop("max_turns")
        if self._open_turn and self.chat is not None:
            self._append_observed(self.chat.generation_prompt)
            self._open_turn = False
        want = self.params.max_tokens if max_tokens is None else max_tokens
        cap = min(want, self.max_len - self.length)
        if cap < 1:
            self.stop("budget", detail=f"{self.length} of {self.max_len} tokens used")
        sample = self.sample
        params, seed = self.params, _turn_seed(sample.seed, self.turns)
        if cap != params.max_tokens or seed != params.seed:
            # attrs.evolve only when the turn's settings differ: it was ~7 us a turn
            params = attrs.evolve(params, max_tokens=cap, seed=seed)
        # the first try awaited here, not in a coroutine of its own (see EpisodeRunner)
        try:
            completion = await self.engine.generate(self._request(params, 0))
        except (EngineTransportError, EngineTimeoutError) as exc:
            completion = await self._retry(params, exc)
        start = len(sample.completion_tokens)
        sample.completion_tokens.extend(completion.tokens)
        sample.logprobs.extend(completion.logprobs)
        sample.loss_mask.extend([True] * len(completion.tokens))
        if completion.finish_reason == "abort":
            raise _AbortedEpisodeError
        sample.policy_versions.append(completion.policy_version)
        self.spans.append((start, len(sample.completion_tokens), completion.policy_version))
        self.turns += 1
        self.stats.turns += 1
        self.last_finish = completion.finish_reason
        text = self.codec.decode(completion.tokens)
        if self.messages is not None:
            self.messages.append({"role": "assistant", "content": text})
        if completion.finish_reason == "length" and cap < want:
            self.stop("budget", detail=f"turn {self.turns} cut at the episode's token budget")
        return text

    def _request(self, params: SamplingParams, retries: int) -> GenerateRequest:
        sample = self.sample
        return GenerateRequest(
            prompt_tokens=self.tokens,
            params=params,
            routing_key=self._routing_key,
            request_id=f"{sample.index}-{self.request_prefix}-{self.turns}-{retries}",
            sample_index=sample.index,
            abort=current_abort(),
        )

    async def _retry(self, params: SamplingParams, failure: Exception) -> Completion:
        """The turn sent again after its try failed with ``failure``, up to ``turn_retries``
        times: the server went away mid-episode, and the prefix is sent again (to another
        server when the engine is a fleet, which routes the key anew)."""
        for retries in range(1, self.config.turn_retries + 1):
            self.stats.turn_retries += 1
            try:
                return await self.engine.generate(self._request(params, retries))
            except (EngineTransportError, EngineTimeoutError) as exc:
                failure = exc
        raise failure

    # ---------------------------------------------------------------------------- observing

    def observe(self, text: str) -> None:
        """Append environment text as tokens that are never trained (encoded alone: the
        tokens before it are never re-tokenized). Stops the episode (``budget``) when they
        do not fit."""
        self.observe_tokens(self.codec.encode(text))
        self.messages = None  # raw text: the conversation is no longer only messages

    def observe_tokens(self, tokens: Sequence[int]) -> None:
        """Append token ids as they are, never trained."""
        self._check_open()
        self._append_observed(tokens)

    def observe_message(self, role: str, content: str) -> None:
        """Append one chat message rendered alone with the chat template (after the closing of
        the assistant turn before it, as the template writes it); the next :meth:`generate`
        opens with the template's generation prompt. Needs a chat template."""
        self._check_open()
        if self.chat is None:
            raise EnvConfigError(
                "Episode.observe_message needs a chat template (a model with one); "
                "use Episode.observe(text) with a model without"
            )
        tokens: tuple[int, ...] = ()
        if self.spans and self.spans[-1][1] == len(self.sample.completion_tokens):
            last = self.sample.completion_tokens[self.spans[-1][0] :]
            tokens = self.chat.closing(last)
        self._append_observed(tokens + self.chat.message(role, content))
        if self.messages is not None:
            self.messages.append({"role": role, "content": content})
        self._open_turn = True

    def _append_observed(self, tokens: Sequence[int]) -> None:
        if self.length + len(tokens) > self.max_len:
            self.stop(
                "budget",
                detail=f"{len(tokens)} observed tokens do not fit ({self.length} of "
                f"{self.max_len} used)",
            )
        sample = self.sample
        sample.completion_tokens.extend(tokens)
        sample.logprobs.extend([0.0] * len(tokens))
        sample.loss_mask.extend([False] * len(tokens))

    # ---------------------------------------------------------------------------- tools

    def cancel_after(self, seconds: float) -> AbstractContextManager[trio.CancelScope]:
        """``with episode.cancel_after(seconds) as scope:``: ``trio.move_on_after(seconds)``,
        its deadline kept by the runner's deadline server while the runner is open (a closed
        scope is then freed at once, not held in trio's deadline heap until it is pruned)."""
        deadlines = self.deadlines
        if deadlines is None or not deadlines.serving:
            return trio.move_on_after(seconds)
        return deadlines.after(seconds)

    async def run_sync(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)`` in a worker thread under the run's capacity limiter; on
        cancellation the thread is abandoned (it runs on, the episode does not wait)."""
        call = functools.partial(fn, *args, **kwargs)
        return await trio.to_thread.run_sync(call, limiter=self.limiter, abandon_on_cancel=True)
