"""The engine interface: one prompt in, one completion out."""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import attrs

from ..samples import PolicyVersion

__all__ = ["Completion", "Engine", "FinishReason", "GenerateRequest", "SamplingParams"]

#: ``stop``: the model ended the completion; ``length``: it hit ``max_tokens``;
#: ``abort``: the engine gave up on the request (e.g. paused for a weight update).
FinishReason = Literal["stop", "length", "abort"]


@attrs.frozen
class SamplingParams:
    max_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    #: Deterministic per-sample seed (the group runner sets ``seed + index in group``).
    seed: int | None = None


@attrs.frozen
class GenerateRequest:
    prompt_tokens: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    #: Cache-affinity key: requests with the same key go to the same server.
    routing_key: str | None = None
    #: Unique per attempt; used for engine-side abort.
    request_id: str = ""


@attrs.frozen
class Completion:
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

    async def generate(self, request: GenerateRequest) -> Completion: ...
