"""``[inference] check_logprobs``: after every reload the engine's logprobs are compared with the
trainer's model scoring the same tokens with the published weights; an engine that did not load
the weights shows a large gap, loudly."""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import pytest
import torch
import trio
from learn_helpers import learn_config

from trio_rl.engines import Completion, GenerateRequest, TorchEngine
from trio_rl.learn import build_model
from trio_rl.learn._logprob_check import GAP_LIMIT, LogprobCheck
from trio_rl.learn._weights import publish_weights
from trio_rl.samples import PolicyVersion

torch.set_num_threads(1)


class _NoReload:
    """An engine whose reload does nothing: it keeps serving the weights it started with."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine

    async def load_weights(self, path: str | os.PathLike[str], version: PolicyVersion) -> None:
        self.engine.version.advance(version)

    async def generate(self, request: GenerateRequest) -> Completion:
        return await self.engine.generate(request)


def _trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # a different policy: every weight moved
    generator = torch.Generator().manual_seed(1)
    return {
        k: v + 0.5 * torch.randn(v.shape, generator=generator)
        for k, v in model.state_dict().items()
    }


@pytest.mark.parametrize("reloads", [True, False])
async def test_the_gap_after_a_reload_is_float_noise_only_when_the_engine_loaded_the_weights(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, reloads: bool
) -> None:
    config = learn_config(
        tmp_path, rollout__task="repeat", run__seed=0, metrics__console=False, metrics__plot=False
    )
    model, tokenizer = build_model(config)
    published = publish_weights(tmp_path / "weights", 1, _trained(model))
    prompts = [tuple(tokenizer.encode(text)) for text in ("a3=", "b5=")]
    lines: list[str] = []
    caplog.set_level(logging.WARNING, logger="trio_rl.learn")
    with trio.fail_after(60):
        async with TorchEngine.open(copy.deepcopy(model).eval(), eos_token_id=1) as torch_engine:
            engine = torch_engine if reloads else _NoReload(torch_engine)
            check = LogprobCheck(
                engine,
                copy.deepcopy(model).eval(),
                prompts,
                max_tokens=6,
                limiter=trio.CapacityLimiter(1),
                report=lines.append,
            )
            await check.load_weights(published.path, 1)
    (gap,) = check.gaps
    assert gap.version == 1
    assert gap.tokens >= 4  # two prompts, two samples each, at least one token apiece
    assert lines == [gap.line()]
    assert lines[0].startswith("reload v1: max |server - trainer| logprob gap ")
    if reloads:
        assert gap.max_gap <= GAP_LIMIT
        assert not caplog.records
    else:
        assert gap.max_gap > 0.01  # the old weights score the tokens differently
        assert "above" in lines[0]
        assert any("do not serve the published weights" in r.getMessage() for r in caplog.records)
