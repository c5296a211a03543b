"""A simulated inference engine: decode slots, straggler distributions, virtual time."""

from __future__ import annotations

import hashlib
import random
from collections import Counter

import attrs
import trio

from .._validation import an_int, positive_finite, positive_int, probability
from ..policy import PolicyVersionCell
from ..samples import PolicyVersion
from ._abort import stop_scope
from ._distributions import LatencyDistribution, LogNormalTokens, get_distribution
from ._errors import SimulatedEngineError
from ._protocol import Completion, FinishReason, GenerateRequest

__all__ = ["EngineStatistics", "SimulatedEngine"]


def _to_distribution(value: str | LatencyDistribution) -> LatencyDistribution:
    return get_distribution(value) if isinstance(value, str) else value


def _seed_of(*parts: object) -> int:
    # repr of ints/strs/tuples is stable across processes (unlike hash() of str).
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@attrs.frozen
class EngineStatistics:
    """A snapshot of a :class:`SimulatedEngine`'s counters.

    ``elapsed`` runs from the first request (or the last :meth:`SimulatedEngine.reset_statistics`)
    to the snapshot; ``busy_slot_seconds`` integrates the number of occupied decode slots over that
    time, so ``occupancy = busy_slot_seconds / (slots x elapsed)``. ``in_flight`` counts requests
    inside ``generate`` (waiting for a slot or decoding); ``decoding`` those holding a slot.
    """

    slots: int
    elapsed: float
    busy_slot_seconds: float
    requests_started: int
    requests_done: int
    requests_failed: int
    requests_cancelled: int
    tokens: int
    in_flight: int
    decoding: int

    @property
    def occupancy(self) -> float:
        """Busy slot-seconds over available slot-seconds (0.0 before any time has passed)."""
        if self.elapsed <= 0:
            return 0.0
        return self.busy_slot_seconds / (self.slots * self.elapsed)


@attrs.define(slots=True, eq=False, kw_only=True)
class SimulatedEngine:
    """An :class:`~trio_rl.engines.Engine` that only sleeps: the default for demos, tests and
    benchmarks.

    It has ``slots`` decode slots; a request waits (FIFO) for a free slot, then holds it for its
    decode time: ``tokens x seconds_per_token`` for token distributions (``long-cot``,
    ``correlated``), or the drawn wall time for ``swe`` and ``heavy-tail``. Under
    ``trio.testing.MockClock(autojump_threshold=0)`` it runs in virtual time, so a simulated hour
    takes milliseconds.

    **Determinism.** Each request draws its length (or wall time), hang, failure and token ids
    from its own ``random.Random``, seeded from the engine ``seed``, the prompt tokens, the
    request's identity and how many times that identity was requested before (so a retry draws
    afresh). The identity is ``request.sample_index`` (with ``params.seed``) when set, as
    :func:`~trio_rl.rollout.engine_generate` does; else ``params.seed``; else ``request_id``.
    What a sample gets therefore never depends on the order in which tasks run or requests
    arrive. A request with none of the three falls back to a global arrival counter, which does.
    The ``correlated`` distribution's per-prompt factor is seeded from the engine seed and the
    prompt tokens only. (The engine keeps one small counter per distinct request identity, so
    memory grows with the number of distinct requests.)

    *When* each request finishes is a different matter: in real time it depends on the clock
    (how fast the host runs the tasks), so which groups finish first, and therefore which
    groups make a batch and how many requests a run makes before it stops, varies between runs
    even with a fixed seed. Under ``trio.testing.MockClock(autojump_threshold=0)`` time is
    virtual and a seeded run is exactly reproducible.

    **Time scale.** ``time_scale`` multiplies every duration, token-based or wall-time, so the
    hour-long ``swe`` and ``heavy-tail`` episodes can run in a demo (``seconds_per_token`` only
    scales the token-based distributions, and sets how many tokens a wall-time episode reports).

    **Faults.** With probability ``hang_rate`` a request holds its slot until cancelled; with
    probability ``failure_rate`` it raises :class:`SimulatedEngineError` part-way through its
    decode time. ``heavy-tail`` additionally has its own hangs, killed at 3600 s with finish
    reason ``abort``.

    **Completions** carry synthetic token ids (consecutive integers) and constant logprobs;
    ``params.max_tokens`` caps the tokens (finish reason ``length``). For wall-time
    distributions it caps only the reported tokens, not the time. The completion is stamped with
    the policy version current when the request got its slot.

    **Abort** (:attr:`GenerateRequest.abort`): the request leaves its slot (or the queue) at
    once and returns the tokens decoded so far, in proportion to the decode time it spent
    (none if it never got a slot), with finish reason ``abort``. A continuation (prompt plus
    those tokens) draws its length afresh, like any request for that prompt.

    **Cancellation**: a cancelled request releases its slot (or its place in the queue) at once
    and ``Cancelled`` propagates; it counts in ``requests_cancelled``.
    """

    distribution: LatencyDistribution = attrs.field(
        default=LogNormalTokens(), converter=_to_distribution, kw_only=False
    )
    slots: int = attrs.field(default=64, validator=positive_int)
    seed: int = attrs.field(default=0, validator=an_int)
    #: Per-sequence decode time; the default is 30 tokens/s.
    seconds_per_token: float = attrs.field(default=1.0 / 30.0, validator=positive_finite)
    failure_rate: float = attrs.field(default=0.0, validator=probability)
    hang_rate: float = attrs.field(default=0.0, validator=probability)
    #: Multiplies every simulated duration, token-based or wall-time (``swe``, ``heavy-tail``,
    #: the ``heavy-tail`` kill time): ``1e-4`` runs a 1500 s episode in 0.15 s of (real or
    #: virtual) time. Token counts do not change.
    time_scale: float = attrs.field(default=1.0, validator=positive_finite)

    _semaphore: trio.Semaphore = attrs.field(init=False)
    #: The policy-version cell this engine stamps; pass the pipeline's to share it.
    version: PolicyVersionCell = attrs.field(factory=PolicyVersionCell)
    _arrivals: int = attrs.field(init=False, default=0)
    _attempts: Counter[tuple[object, ...]] = attrs.field(init=False, factory=Counter)
    _t0: float | None = attrs.field(init=False, default=None)
    _last_change: float = attrs.field(init=False, default=0.0)
    _busy_slot_seconds: float = attrs.field(init=False, default=0.0)
    _decoding: int = attrs.field(init=False, default=0)
    _in_flight: int = attrs.field(init=False, default=0)
    _started: int = attrs.field(init=False, default=0)
    _done: int = attrs.field(init=False, default=0)
    _failed: int = attrs.field(init=False, default=0)
    _cancelled: int = attrs.field(init=False, default=0)
    _tokens: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._semaphore = trio.Semaphore(self.slots)

    @property
    def policy_version(self) -> PolicyVersion:
        """The version stamped on completions that get a slot from now on."""
        return self.version.value

    def set_policy_version(self, version: PolicyVersion) -> None:
        """Switch to a new policy version (as after a weight update). Versions never go back."""
        self.version.advance(version)

    def reset_statistics(self) -> None:
        """Start a new measurement window now (counters to zero; requests in flight stay)."""
        now = trio.current_time()
        self._t0 = now
        self._last_change = now
        self._busy_slot_seconds = 0.0
        self._started = self._done = self._failed = self._cancelled = self._tokens = 0

    def statistics(self) -> EngineStatistics:
        """Counters and slot occupancy since the first request or the last reset."""
        if self._t0 is None:
            elapsed, busy = 0.0, 0.0
        else:
            now = trio.current_time()
            elapsed = now - self._t0
            busy = self._busy_slot_seconds + self._decoding * (now - self._last_change)
        return EngineStatistics(
            slots=self.slots,
            elapsed=elapsed,
            busy_slot_seconds=busy,
            requests_started=self._started,
            requests_done=self._done,
            requests_failed=self._failed,
            requests_cancelled=self._cancelled,
            tokens=self._tokens,
            in_flight=self._in_flight,
            decoding=self._decoding,
        )

    def _occupy(self, delta: int) -> None:
        now = trio.current_time()
        self._busy_slot_seconds += self._decoding * (now - self._last_change)
        self._last_change = now
        self._decoding += delta

    def _rngs(self, request: GenerateRequest) -> tuple[random.Random, random.Random]:
        prompt_seed = _seed_of(self.seed, "prompt", request.prompt_tokens)
        identity: object
        if request.sample_index is not None:
            identity = ("sample", request.sample_index, request.params.seed)
        elif request.params.seed is not None:
            identity = ("seed", request.params.seed)
        elif request.request_id:
            identity = ("id", request.request_id)
        else:
            identity = ("arrival", self._arrivals)
        self._arrivals += 1
        key = (prompt_seed, identity)
        attempt = self._attempts[key]
        self._attempts[key] = attempt + 1
        return random.Random(_seed_of(self.seed, key, attempt)), random.Random(prompt_seed)

    async def generate(self, request: GenerateRequest) -> Completion:
        """Wait for a slot, decode for the drawn time, return the completion.

        Raises :class:`SimulatedEngineError` for an injected failure. On cancellation the
        slot (or the place in the queue) is released and ``Cancelled`` propagates.
        """
        if self._t0 is None:
            self.reset_statistics()
        rng, prompt_rng = self._rngs(request)
        draw = self.distribution.draw(rng, prompt_rng)
        hang = rng.random() < self.hang_rate
        fail = rng.random() < self.failure_rate
        fail_at = rng.random()
        first_token = rng.randrange(1000)
        logprob = -rng.random()

        max_tokens = request.params.max_tokens
        finish: FinishReason = draw.finish_reason
        if draw.tokens is not None:
            n_tokens = min(draw.tokens, max_tokens)
            duration = n_tokens * self.seconds_per_token * self.time_scale
            if draw.tokens >= max_tokens and finish == "stop":
                finish = "length"
        else:
            assert draw.seconds is not None
            n_tokens = max(1, min(max_tokens, round(draw.seconds / self.seconds_per_token)))
            duration = draw.seconds * self.time_scale

        self._in_flight += 1
        self._started += 1
        version = self.version.value
        started: float | None = None
        try:
            with stop_scope(request.abort) as stop:
                async with self._semaphore:
                    self._occupy(+1)
                    started = trio.current_time()
                    try:
                        version = self.version.value
                        if hang:
                            await trio.sleep_forever()
                        if fail:
                            await trio.sleep(duration * fail_at)
                            raise SimulatedEngineError(
                                f"injected failure (failure_rate={self.failure_rate}) for "
                                f"request {request.request_id!r} after "
                                f"{duration * fail_at:.3f}s"
                            )
                        await trio.sleep(duration)
                    finally:
                        self._occupy(-1)
        except trio.Cancelled:
            self._cancelled += 1
            raise
        except SimulatedEngineError:
            self._failed += 1
            raise
        finally:
            self._in_flight -= 1
        if stop.cancelled_caught:
            # aborted: the tokens decoded so far, in proportion to the decode time spent
            finish = "abort"
            if started is None or duration <= 0:
                n_tokens = 0
            else:
                spent = (trio.current_time() - started) / duration
                n_tokens = min(n_tokens, int(n_tokens * spent))
        self._done += 1
        self._tokens += n_tokens
        return Completion(
            tokens=list(range(first_token, first_token + n_tokens)),
            logprobs=[logprob] * n_tokens,
            finish_reason=finish,
            policy_version=version,
        )
