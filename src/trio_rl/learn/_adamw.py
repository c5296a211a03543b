"""AdamW for the reference trainer: torch's update to the bit, without ``torch.optim``.

``torch.optim``'s optimizers wrap their methods to keep ``torch.compile`` out of them, and
that wrapper imports ``torch._dynamo`` (and sympy) on the first call: 3.0 s of every learning
run's and trainer job's start on this 2-core machine (the first log line of
``examples/learn-quick.toml`` 6.3 s after the process started, 3.3 s without it), spent before
the event loop can take a signal. This class is the update ``torch.optim.AdamW`` makes on CPU
tensors (its single-tensor path: no ``foreach``, ``fused``, ``amsgrad`` or ``maximize``), and
its state dict has torch's layout, so a trainer state saved by one loads in the other.
``tests/learn/test_learn_adamw.py`` holds it to ``torch.optim.AdamW`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["AdamW"]


class AdamW:
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` for one parameter group.

    What the trainer uses of an optimizer: ``zero_grad``, ``step``, ``state_dict``,
    ``load_state_dict`` and ``param_groups[0]["lr"]``. As with torch, a loaded state dict's
    hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``) replace the constructor's.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        self.params = list(params)
        # torch's keys and defaults, so that torch.optim.AdamW loads what this saves
        self.param_groups: list[dict[str, Any]] = [
            {
                "lr": lr,
                "betas": betas,
                "eps": eps,
                "weight_decay": weight_decay,
                "amsgrad": False,
                "foreach": None,
                "maximize": False,
                "capturable": False,
                "differentiable": False,
                "fused": None,
                "decoupled_weight_decay": True,
                "params": self.params,
            }
        ]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, (beta1, beta2) = group["lr"], group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        for param in self.params:
            grad = param.grad
            if grad is None:
                continue
            state = self.state.get(param)
            if state is None:
                # torch keeps the step count as a float32 tensor on the CPU
                state = self.state[param] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }
            step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
            # the operations of torch.optim.adam._single_tensor_adam, in its order
            step_t += 1
            if weight_decay != 0:
                param.mul_(1 - lr * weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = step_t.item()
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            step_size = lr / bias_correction1
            bias_correction2_sqrt = bias_correction2**0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: per-parameter state by index, the group with its parameters' indices."""
        index = {id(p): i for i, p in enumerate(self.params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.params)))
        return {
            "state": {index[id(p)]: dict(s) for p, s in self.state.items()},
            "param_groups": [group],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim.AdamW`` (one group, the same
        parameters in the same order); ``ValueError`` naming what does not fit."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != 1:
            raise ValueError("the optimizer state has no single parameter group")
        saved = groups[0]
        if len(saved.get("params", ())) != len(self.params):
            raise ValueError(
                f"the optimizer state is for {len(saved.get('params', ()))} parameters, "
                f"the model has {len(self.params)}"
            )
        state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for i, s in state_dict.get("state", {}).items():
            param = self.params[int(i)]
            state[param] = {
                "step": torch.as_tensor(s["step"], dtype=torch.float32).clone(),
                "exp_avg": s["exp_avg"].to(dtype=param.dtype, device=param.device).clone(),
                "exp_avg_sq": s["exp_avg_sq"].to(dtype=param.dtype, device=param.device).clone(),
            }
        self.state = state
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in saved:
                value = saved[key]
                self.param_groups[0][key] = tuple(value) if key == "betas" else value
