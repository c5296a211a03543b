"""The engine interface: one prompt in, one completion out."""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import attrs

from .._validation import non_negative_finite, open_unit, optional_int, positive_int
from ..samples import PolicyVersion
from ._abort import AbortSignal

__all__ = ["AbortsAll", "Completion", "Engine", "FinishReason", "GenerateRequest", "SamplingParams"]

#: ``stop``: the model ended the completion; ``length``: it hit ``max_tokens``;
#: ``abort``: the engine gave up on the request (e.g. paused for a weight update).
FinishReason = Literal["stop", "length", "abort"]


@attrs.frozen
class SamplingParams:
    """How to sample one completion. Bad values (``max_tokens < 1``, a negative or infinite
    ``temperature``, ``top_p`` outside (0, 1]) raise
    :class:`~trio_rl.engines.EngineConfigError` here, not at the first request."""

    max_tokens: int = attrs.field(default=1024, validator=positive_int)
    temperature: float = attrs.field(default=1.0, validator=non_negative_finite)
    top_p: float = attrs.field(default=1.0, validator=open_unit)
    #: Deterministic per-sample seed (given by the group factory, by its ``seeds`` rule).
    seed: int | None = attrs.field(default=None, validator=optional_int)


@attrs.frozen
class GenerateRequest:
    """One completion to generate: the prompt as token ids and how to sample it.

    A request that continues a partial generation carries the prompt *and* the tokens
    generated so far as ``prompt_tokens`` (and ``max_tokens`` reduced by their count); engines
    need no other notion of continuation.
    """

    prompt_tokens: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    #: Cache-affinity key: requests with the same key go to the same server.
    routing_key: str | None = None
    #: Unique per attempt; used for engine-side abort.
    request_id: str = ""
    #: The run-wide index of the sample this request generates (``engine_generate`` sets it).
    #: Real engines ignore it; :class:`~trio_rl.engines.SimulatedEngine` keys its random draws
    #: on it, so what a sample gets does not depend on the order requests arrive in.
    sample_index: int | None = None
    #: Soft stop. Once this signal is set the engine ends the request and *returns* what it
    #: generated so far with finish reason ``abort`` (possibly no tokens), instead of raising
    #: ``Cancelled``: the partial generation can be continued later. See each engine for how
    #: much of the partial output it can return.
    abort: AbortSignal | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class Completion:
    """What an engine generated for one request.

    ``tokens`` and ``logprobs`` (under the sampling distribution) align one to one.
    ``finish_reason`` is ``stop``, ``length`` or ``abort``; an ``abort`` completion (from
    :attr:`GenerateRequest.abort` or the engine giving up) holds the partial output, which may
    be empty.
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    #: The policy version that generated these tokens.
    policy_version: PolicyVersion


@runtime_checkable
class Engine(Protocol):
    """Generates one completion.

    Implementations must be cancellable: when the calling task is cancelled the request is
    abandoned (and aborted engine-side where the engine supports it) and ``Cancelled``
    propagates.
    """

    async def generate(self, request: GenerateRequest) -> Completion:
        """Generate one completion for ``request``.

        Cancellation: the request is abandoned (aborted engine-side where the engine supports
        it) and `trio.Cancelled` propagates; no completion is returned.
        """
        ...


@runtime_checkable
class AbortsAll(Protocol):
    """An engine that can abort every request it has running on its servers at once
    (:class:`~trio_rl.engines.OpenAICompatibleEngine`, :class:`~trio_rl.engines.EngineFleet`):
    the sync driver's ``engine_abort``, called when a batch is full and groups are still out."""

    async def abort_all(self) -> None:
        """Abort every running request engine-side; best effort, bounded in time.

        Cancellation: the aborts already posted stand; `trio.Cancelled` propagates.
        """
        ...
