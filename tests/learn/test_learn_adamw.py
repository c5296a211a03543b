"""The reference trainer's AdamW is torch.optim.AdamW's update, bit for bit, and their state
dicts load in each other."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from trio_rl.learn._adamw import AdamW


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(model: nn.Sequential, opt: Any, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 7, generator=gen)
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        # a parameter without a gradient is left alone by both
        model[2].bias.grad = None
        opt.step()


def _same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize(
    ("lr", "betas", "weight_decay"),
    [(1e-3, (0.9, 0.999), 0.01), (0.3, (0.9, 0.99), 0.0), (3e-2, (0.5, 0.9), 0.1)],
)
def test_every_step_is_torchs_to_the_bit(
    lr: float, betas: tuple[float, float], weight_decay: float
) -> None:
    ours, theirs = _model(0), _model(0)
    kw: dict[str, Any] = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
    _train(ours, AdamW(ours.parameters(), **kw), 25, seed=1)
    _train(theirs, torch.optim.AdamW(theirs.parameters(), **kw), 25, seed=1)
    _same(ours, theirs)


def test_state_dicts_load_both_ways_and_training_goes_on_alike() -> None:
    kw: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.01}
    a, b = _model(3), _model(3)
    opt_a = AdamW(a.parameters(), **kw)
    opt_b = torch.optim.AdamW(b.parameters(), **kw)
    _train(a, opt_a, 4, seed=5)
    _train(b, opt_b, 4, seed=5)
    # swap: each optimizer resumes from the other's saved state, on a copy of its model
    a2, b2 = _model(0), _model(0)
    a2.load_state_dict(b.state_dict())
    b2.load_state_dict(a.state_dict())
    resumed_ours = AdamW(a2.parameters(), lr=0.5)  # the saved lr replaces this one, as torch's
    resumed_ours.load_state_dict(opt_b.state_dict())
    resumed_theirs = torch.optim.AdamW(b2.parameters(), lr=0.5)
    resumed_theirs.load_state_dict(opt_a.state_dict())
    assert resumed_ours.param_groups[0]["lr"] == 1e-2
    _train(a2, resumed_ours, 4, seed=6)
    _train(b2, resumed_theirs, 4, seed=6)
    _same(a2, b2)


def test_a_state_for_other_parameters_is_refused_by_name() -> None:
    opt = AdamW(_model(0).parameters())
    with pytest.raises(ValueError, match="for 1 parameters, the model has 4"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})


def test_the_trainer_does_not_import_torch_dynamo() -> None:
    # torch.optim's first call imports torch._dynamo: seconds of every run's start
    code = (
        "import sys, torch\n"
        "from torch import nn\n"
        "from trio_rl.learn._grpo import GRPOTrainer\n"
        "t = GRPOTrainer(nn.Linear(2, 2))\n"
        "t.optimizer.zero_grad(); t.optimizer.step(); t.optimizer.load_state_dict("
        "t.optimizer.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
