"""The reference GRPO trainer: micro-batches from the transport in, AdamW steps out.

Synchronous and thread-safe for one caller at a time: a trio trainer runs :meth:`train_step`
in a worker thread. Under ``torch.distributed`` (gloo, one process per rank, e.g. torchrun)
the model is wrapped in ``DistributedDataParallel``; every rank trains on its own micro-batches
and gradients are all-reduced, so the step equals one rank's step on the global batch.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..trainer import TrainerConfig, TrainerTensors, to_torch
from ..wire import MicroBatch
from ._adamw import AdamW
from ._model import sequence_logprobs_entropy

__all__ = [
    "TRAINER_KEYS",
    "GRPOTrainer",
    "StepStats",
    "grpo_token_losses",
    "grpo_token_terms",
]


@attrs.frozen
class StepStats:
    """What one :meth:`GRPOTrainer.train_step` did, over every rank. ``loss`` (the clipped
    policy-gradient loss, token mean, without the entropy bonus), ``ratio_mean`` (importance
    ratio against the inference logprobs), ``clipped_fraction``, ``kl`` (the k3 estimator of
    KL(behaviour || current), ``mean(r - 1 - log r)``) and ``entropy`` (mean token entropy,
    nats) are those of the step's first update, before the policy moved; ``grad_norm`` is the
    first update's gradient norm before clipping; ``lr`` the learning rate of the step;
    ``seconds`` its wall time and ``tokens_per_s`` the loss tokens over it."""

    step: int
    loss_tokens: int
    loss: float
    ratio_mean: float
    clipped_fraction: float
    kl: float = math.nan
    entropy: float = math.nan
    grad_norm: float = math.nan
    lr: float = math.nan
    seconds: float = 0.0
    tokens_per_s: float = 0.0

    def metrics(self) -> dict[str, Any]:
        """The ``trainer/...`` fields of the step's metrics record (non-finite values: None)."""
        values = {
            "trainer/loss": self.loss,
            "trainer/clip_frac": self.clipped_fraction,
            "trainer/ratio_mean": self.ratio_mean,
            "trainer/kl": self.kl,
            "trainer/entropy": self.entropy,
            "trainer/grad_norm": self.grad_norm,
            "trainer/lr": self.lr,
            "trainer/tokens_per_s": self.tokens_per_s,
        }
        return {k: (v if math.isfinite(v) else None) for k, v in values.items()}


#: The keys :meth:`StepStats.metrics` adds to every trained step's record.
TRAINER_KEYS = tuple(StepStats(0, 0, 0.0, 0.0, 0.0).metrics())


def _sequences(t: TrainerTensors) -> list[tuple[int, int]]:
    """(start, length) of every sequence packed into a micro-batch."""
    out, start = [], 0
    for length in t.seq_lens.tolist():
        out.append((start, int(length)))
        start += int(length)
    return out


def grpo_token_losses(
    model: nn.Module, t: TrainerTensors, clip: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped GRPO losses of one micro-batch, with ratios and a clipped flag.

    Returns ``(losses, ratios, clipped)`` over the loss-masked tokens only. Sequences are
    unpacked by ``seq_lens`` and scored at their own temperature; the ratio is
    ``exp(logprob - inference_logprob)``.
    """
    losses, ratios, clipped, _, _ = grpo_token_terms(model, t, clip)
    return losses, ratios, clipped


def grpo_token_terms(
    model: nn.Module, t: TrainerTensors, clip: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`grpo_token_losses` plus, per loss token, the entropy of its distribution (with
    gradient, for the entropy bonus) and the k3 KL estimate against the behaviour policy
    (``r - 1 - log r``, detached): ``(losses, ratios, clipped, entropies, kl)``."""
    ids = t.input_ids[0]
    spans = _sequences(t)
    seqs = [ids[s : s + n] for s, n in spans]
    temps = t.temperatures[0]
    by_temp: dict[float, list[int]] = {}
    for i, (s, _) in enumerate(spans):
        by_temp.setdefault(float(temps[s]), []).append(i)
    empty = ids.new_zeros(0, dtype=torch.float32)
    logps: list[torch.Tensor] = [empty] * len(seqs)
    ents: list[torch.Tensor] = [empty] * len(seqs)
    for temp, members in by_temp.items():
        scored, entropy = sequence_logprobs_entropy(
            model, [seqs[i] for i in members], temperature=temp or 1.0
        )
        for i, lp, h in zip(members, scored, entropy, strict=True):
            logps[i], ents[i] = lp, h
    new = torch.cat(logps)
    mask = t.loss_mask[0]
    old = t.inference_logprobs[0][mask]
    adv = t.advantages[0][mask]
    log_ratio = new[mask] - old
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip, 1.0 + clip)
    losses = -torch.minimum(ratio * adv, clipped_ratio * adv)
    clipped = (ratio * adv) > (clipped_ratio * adv)
    lr_d = log_ratio.detach()
    kl = torch.exp(lr_d) - 1.0 - lr_d
    return losses, ratio.detach(), clipped, torch.cat(ents)[mask], kl


class GRPOTrainer:
    """Trains ``model`` on the micro-batches of one rank per step.

    With ``torch.distributed`` initialised, the model is wrapped in DDP: the loss of each rank
    is its sum of token losses divided by the global number of loss tokens times the world size,
    so DDP's gradient average is the global token-mean loss's gradient.
    """

    def __init__(self, model: nn.Module, config: TrainerConfig | None = None) -> None:
        self.config = config if config is not None else TrainerConfig()
        self.model = model
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._wrapped: nn.Module = DistributedDataParallel(model) if self.distributed else model
        self.optimizer = AdamW(
            model.parameters(),
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _global_tokens(self, tensors: Sequence[TrainerTensors]) -> int:
        count = torch.tensor([sum(int(t.loss_mask.sum()) for t in tensors)], dtype=torch.int64)
        if self.distributed:
            dist.all_reduce(count)
        return int(count.item())

    def train_step(self, step: int, micro_batches: Sequence[MicroBatch]) -> StepStats:
        """One optimisation step on this rank's ``micro_batches`` (every rank must call it)."""
        started = time.perf_counter()
        tensors = [to_torch(mb) for mb in micro_batches]
        total = self._global_tokens(tensors)
        self.model.train()
        if self.distributed and not tensors:  # pragma: no cover - the packer gives every rank some
            raise RuntimeError("a rank got no micro-batch; DDP needs one per rank")
        coef = self.config.entropy_coef
        scale = self.world_size / max(total, 1)
        # the figures of the first update: the policy as it was against the inference logprobs
        sums = [0.0] * 5  # loss, ratio, clipped, entropy, kl
        grad_norm = math.nan
        for epoch in range(self.config.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for k, t in enumerate(tensors):
                last = k == len(tensors) - 1
                sync = self.distributed and not last
                ctx = self._wrapped.no_sync() if sync else contextlib.nullcontext()  # type: ignore[operator]
                with ctx:
                    losses, ratios, clipped, entropy, kl = grpo_token_terms(
                        self._wrapped, t, self.config.clip
                    )
                    objective = losses.sum()
                    if coef:
                        objective = objective - coef * entropy.sum()
                    (objective * scale).backward()  # type: ignore[no-untyped-call]
                if epoch == 0:
                    for i, v in enumerate((losses.detach(), ratios, clipped, entropy.detach(), kl)):
                        sums[i] += float(v.sum())
            norm = self._clip_gradients()
            if epoch == 0:
                grad_norm = norm
            self.optimizer.step()
        local = torch.tensor(sums, dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(local)
        denom = max(total, 1)
        loss_v, ratio_v, clipped_v, entropy_v, kl_v = (float(x) for x in local.tolist())
        seconds = time.perf_counter() - started
        return StepStats(
            step=step,
            loss_tokens=total,
            loss=loss_v / denom,
            ratio_mean=ratio_v / denom if total else math.nan,
            clipped_fraction=clipped_v / denom,
            kl=kl_v / denom if total else math.nan,
            entropy=entropy_v / denom if total else math.nan,
            grad_norm=grad_norm,
            lr=float(self.optimizer.param_groups[0]["lr"]),
            seconds=seconds,
            tokens_per_s=total / seconds if seconds > 0 else math.nan,
        )

    def _clip_gradients(self) -> float:
        """Clip to ``max_grad_norm`` (if set); the norm before clipping (after DDP's
        all-reduce, so every rank sees the global gradient's norm)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.config.max_grad_norm is not None:
            return float(nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
        if not params:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))  # type: ignore[union-attr]
