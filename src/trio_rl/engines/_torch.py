"""An in-process torch engine: batched sampling from a causal language model in worker threads.

torch is an optional extra: this module imports it only when an engine is opened, so
``import trio_rl.engines`` stays light.
"""

from __future__ import annotations

import copy
import functools
import os
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from ..policy import PolicyVersionCell, as_cell
from ..samples import PolicyVersion
from ._batching import PendingRow, RequestBatcher, batch_key, length_key
from ._errors import EngineConfigError, EngineError
from ._protocol import Completion, FinishReason, GenerateRequest

if TYPE_CHECKING:
    import torch

__all__ = ["TorchEngine", "TorchEngineStatistics", "WEIGHTS_FILE"]

#: The file a published weights directory holds (``load_weights`` accepts the directory).
WEIGHTS_FILE = "model.safetensors"


@attrs.frozen
class TorchEngineStatistics:
    """Counters of a :class:`TorchEngine` since it was opened."""

    requests: int
    completions: int
    abandoned: int
    tokens: int
    batches: int
    decode_steps: int
    running_batches: int
    weight_loads: int
    #: ``max_batch``: the rows a decode batch may hold (the engine's slots).
    slots: int = 0
    #: Row-seconds of finished batches: each row counts its whole batch's decode time (a row
    #: holds its place until the batch ends, no KV cache to free it early).
    busy_row_seconds: float = 0.0
    #: Seconds (trio clock) since the first batch started.
    elapsed: float = 0.0

    @property
    def busy_slot_seconds(self) -> float:
        """``busy_row_seconds``: a row is the engine's slot."""
        return self.busy_row_seconds

    @property
    def occupancy(self) -> float:
        """Busy row-seconds over available row-seconds (0.0 before any batch)."""
        if self.elapsed <= 0 or self.slots <= 0:
            return 0.0
        return min(1.0, self.busy_row_seconds / (self.slots * self.elapsed))


def _sample(
    torch: Any, logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` [B, V]; return the ids and their logprobs under the
    sampling distribution (temperature, then top-p). Temperature 0 is greedy and reports the
    untempered logprob."""
    if temperature == 0.0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
        return tokens, logp.gather(1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(logp.exp(), dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _decode(
    model: Any,
    rows: list[PendingRow],
    version: PolicyVersion,
    *,
    eos: int,
    rng: random.Random,
    counts: dict[str, int],
) -> list[Completion | None]:
    """Worker thread: decode ``rows`` (one prompt) step by step until all are finished.

    Rows abandoned or aborted by their callers leave before the next step; an abandoned row
    gets None, an aborted one its tokens so far with finish reason ``abort``.
    """
    import torch

    first = rows[0].request
    params = first.params
    n = len(rows)
    seeds = [r.request.params.seed for r in rows]
    # One generator per batch, seeded by its rows' seeds: a group decoded together (as the
    # group runner submits it) samples the same tokens on every run.
    gen = torch.Generator()
    if any(seed is None for seed in seeds):
        gen.manual_seed(rng.getrandbits(63))
    else:
        gen.manual_seed(hash(tuple(seeds)) & (2**63 - 1))
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    finish: list[FinishReason | None] = [None] * n
    active = list(range(n))
    x = torch.tensor([r.request.prompt_tokens for r in rows], dtype=torch.int64)
    with torch.no_grad():
        for _ in range(params.max_tokens):
            trio.from_thread.check_cancelled()
            keep = [j for j, i in enumerate(active) if not (rows[i].abandoned or rows[i].aborted)]
            if len(keep) < len(active):
                for i in active:
                    if rows[i].abandoned or rows[i].aborted:
                        finish[i] = "abort"
                active = [active[j] for j in keep]
                x = x[keep]
            if not active:
                break
            logits = model(x)[:, -1].float()
            counts["decode_steps"] += 1
            step_tokens, step_logprobs = _sample(
                torch, logits, params.temperature, params.top_p, gen
            )
            for i, tok, lp in zip(
                active, step_tokens.tolist(), step_logprobs.tolist(), strict=True
            ):
                tokens[i].append(tok)
                logprobs[i].append(lp)
                if tok == eos:
                    finish[i] = "stop"
            x = torch.cat([x, step_tokens[:, None]], dim=1)
            running = (step_tokens != eos).nonzero()[:, 0]
            if len(running) < len(active):
                active = [active[j] for j in running.tolist()]
                x = x[running]
    return [
        None
        if rows[i].abandoned
        else Completion(tokens[i], logprobs[i], finish[i] or "length", version)
        for i in range(n)
    ]


class TorchEngine:
    """An :class:`~trio_rl.engines.Engine` over an in-process causal LM (``model(ids [B, T]) ->
    logits [B, T, V]``), opened with ``async with TorchEngine.open(model, eos_token_id=...)``.

    Concurrent requests for the same prompt and sampling settings (the ``n`` samples of a
    group) that arrive within ``gather_window`` seconds are generated together as one batch
    (:class:`~trio_rl.engines._batching.RequestBatcher`); each batch decodes in a worker thread
    (``trio.to_thread.run_sync`` under ``limiter``), without a KV cache (the models here are
    tiny). A batch samples from one generator seeded by its rows' ``params.seed`` values, so a
    group decoded together gets the same tokens on every run with the same weights. With
    ``batch_by="length"`` requests whose prompts differ but have the same length share batches
    too (the later turns of multi-turn episodes: each episode's prompt is its own).

    **Abort** (:attr:`GenerateRequest.abort`): the row is ended before the next decode step and
    returns the tokens decoded so far with finish reason ``abort``. A continuation request
    (prompt plus those tokens) decodes on from there.

    Cancelling a request marks its row abandoned: the decode thread drops it before the next
    decode step and stops when no row is left. Closing the engine stops every batch between two
    decode steps (``trio.from_thread.check_cancelled``).

    :meth:`load_weights` reads a new state dict into a copy of the model in a worker thread and
    then swaps it in. Batches that are running finish on the weights they started with and
    report that version, so every completion is generated by exactly one policy version.
    """

    def __init__(
        self,
        model: Any,
        *,
        eos_token_id: int,
        max_len: int | None = None,
        max_batch: int = 64,
        gather_window: float = 0.002,
        limiter: trio.CapacityLimiter | None = None,
        policy_version: PolicyVersion | PolicyVersionCell = 0,
        seed: int = 0,
        batch_by: Literal["prompt", "length"] = "prompt",
    ) -> None:
        if batch_by not in ("prompt", "length"):
            raise EngineConfigError(
                f'TorchEngine.batch_by must be "prompt" or "length", got {batch_by!r}'
            )
        if max_batch < 1:
            raise EngineConfigError(f"TorchEngine.max_batch must be >= 1, got {max_batch}")
        if gather_window < 0:
            raise EngineConfigError(f"TorchEngine.gather_window must be >= 0, got {gather_window}")
        self._model = model
        self._eos = eos_token_id
        self._max_len = max_len
        self.limiter = limiter if limiter is not None else trio.CapacityLimiter(1)
        #: The policy-version cell this engine stamps (pass the pipeline's to share it).
        self.version = as_cell(policy_version)
        self._rng = random.Random(seed)
        self._batcher = RequestBatcher(
            "TorchEngine",
            self._run_rows,
            lambda: self.version.value,
            window=gather_window,
            max_rows=max_batch,
            abort_waits=True,
            key=batch_key if batch_by == "prompt" else length_key,
        )
        self._counts = dict.fromkeys(
            ("requests", "completions", "abandoned", "tokens", "batches", "decode_steps"), 0
        )
        self._running = 0
        self._loads = 0
        self._slots = max_batch
        self._busy_row_seconds = 0.0
        self._t0: float | None = None

    @classmethod
    @asynccontextmanager
    async def open(cls, model: Any, **kwargs: Any) -> AsyncIterator[TorchEngine]:
        """Open an engine over ``model`` (keyword arguments as in the constructor).

        Leaving the block cancels every batch: decode threads stop before their next decode
        step and every pending ``generate`` raises ``trio.ClosedResourceError``.
        """
        engine = cls(model, **kwargs)
        async with trio.open_nursery() as nursery:
            engine._batcher.nursery = nursery
            try:
                yield engine
            finally:
                engine._batcher.nursery = None
                nursery.cancel_scope.cancel()

    @property
    def policy_version(self) -> PolicyVersion:
        """The version of the weights new batches start with."""
        return self.version.value

    @property
    def model(self) -> Any:
        """The current model (replaced, never mutated, by :meth:`load_weights`)."""
        return self._model

    def statistics(self) -> TorchEngineStatistics:
        elapsed = 0.0 if self._t0 is None else trio.current_time() - self._t0
        return TorchEngineStatistics(
            **self._counts,
            running_batches=self._running,
            weight_loads=self._loads,
            slots=self._slots,
            busy_row_seconds=self._busy_row_seconds,
            elapsed=elapsed,
        )

    async def generate(self, request: GenerateRequest) -> Completion:
        """Generate one completion; see the class docstring for batching, abort and
        cancellation (the row is dropped and `trio.Cancelled` propagates).

        Raises ``trio.ClosedResourceError`` outside :meth:`open`
        and :class:`~trio_rl.engines.EngineError` when the prompt is empty or too long for the
        model, or when the decode thread fails.
        """
        if self._batcher.nursery is None:
            raise trio.ClosedResourceError("TorchEngine used outside TorchEngine.open()")
        if not request.prompt_tokens:
            raise EngineError(f"request {request.request_id!r}: empty prompt")
        p = request.params
        if self._max_len is not None and len(request.prompt_tokens) + p.max_tokens > self._max_len:
            raise EngineError(
                f"request {request.request_id!r}: {len(request.prompt_tokens)} prompt tokens + "
                f"max_tokens {p.max_tokens} exceed the model's max_len {self._max_len}"
            )
        self._counts["requests"] += 1
        try:
            return await self._batcher.submit(request)
        except trio.Cancelled:
            self._counts["abandoned"] += 1
            raise
        except (trio.ClosedResourceError, EngineError):
            raise
        except Exception as exc:
            raise EngineError(
                f"request {request.request_id!r}: the decode thread failed: {exc!r}"
            ) from exc

    async def _run_rows(self, rows: list[PendingRow]) -> None:
        # Seeded rows decode in seed order, not arrival order (trio varies the order in which
        # a group's sample tasks run): row i then draws the same tokens on every run.
        rows = sorted(
            rows, key=lambda r: (r.request.params.seed is None, r.request.params.seed or 0)
        )
        model, version = self._model, self.version.value
        self._running += 1
        self._counts["batches"] += 1
        begun = trio.current_time()
        if self._t0 is None:
            self._t0 = begun
        try:
            decode = functools.partial(_decode, eos=self._eos, rng=self._rng, counts=self._counts)
            results = await trio.to_thread.run_sync(
                decode, model, rows, version, limiter=self.limiter
            )
        except Exception as exc:
            for r in rows:
                r.error = exc
            return
        finally:
            self._running -= 1
            self._busy_row_seconds += len(rows) * (trio.current_time() - begun)
        for r, completion in zip(rows, results, strict=True):
            r.completion = completion
            if completion is not None:
                self._counts["completions"] += 1
                self._counts["tokens"] += len(completion.tokens)

    async def load_weights(self, path: str | os.PathLike[str], version: PolicyVersion) -> None:
        """Load the safetensors weights at ``path`` (a file, or a directory holding
        ``model.safetensors``) as policy ``version``; requests started after this returns use them.

        The file is read into a copy of the model in a worker thread; the swap happens on the
        loop. Raises :class:`~trio_rl.engines.EngineError` naming the path when the file is
        missing or does not fit the model, and ``ValueError`` when ``version`` goes back.
        Cancellation: the worker thread finishes its read, the old weights stay in place.
        """
        self.version.check(version)
        model = await trio.to_thread.run_sync(self._load_copy, Path(path), limiter=self.limiter)
        self._model = model
        self.version.advance(version)
        self._loads += 1

    def _load_copy(self, file: Path) -> Any:
        from safetensors.torch import load_file

        if file.is_dir():
            file = file / WEIGHTS_FILE
        try:
            state = load_file(str(file))
        except (OSError, RuntimeError) as exc:  # safetensors raises its own errors as well
            raise EngineError(f"cannot read weights {file}: {exc}") from exc
        except Exception as exc:
            raise EngineError(f"cannot read weights {file}: {exc}") from exc
        model = copy.deepcopy(self._model)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise EngineError(f"weights {file} do not fit the model: {exc}") from exc
        model.eval()
        return model
