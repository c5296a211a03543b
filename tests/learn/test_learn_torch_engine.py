"""TorchEngine: real logprobs, batching, cancellation between decode steps, weight loading."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from trio_rl.engines import (
    AbortSignal,
    EngineError,
    GenerateRequest,
    SamplingParams,
    TorchEngine,
)
from trio_rl.learn import TASKS, CharTransformer, ModelConfig, publish_weights, sequence_logprobs

torch.set_num_threads(1)
TASK = TASKS["copy"]
EOS = 1


def _model(seed: int = 0, max_len: int = 48) -> CharTransformer:
    torch.manual_seed(seed)
    model = CharTransformer(ModelConfig(TASK.tokenizer.vocab_size, max_len=max_len))
    # a non-uniform head, so logprobs differ from token to token
    torch.nn.init.normal_(model.head.weight, std=0.5)
    return model.eval()


def _request(prompt: str, seed: int, max_tokens: int = 7, **kw: Any) -> GenerateRequest:
    return GenerateRequest(
        prompt_tokens=TASK.tokenizer.encode(prompt),
        params=SamplingParams(max_tokens=max_tokens, seed=seed, **kw),
        request_id=f"r{seed}",
    )


async def _generate_group(engine: TorchEngine, prompt: str, n: int, **kw: Any) -> list[Any]:
    out: list[Any] = [None] * n

    async def one(i: int) -> None:
        out[i] = await engine.generate(_request(prompt, seed=100 + i, **kw))

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_reported_logprobs_equal_the_trainers_recomputed_ones(temperature: float) -> None:
    model = _model()
    with trio.fail_after(30):
        async with TorchEngine.open(model, eos_token_id=EOS, max_len=48) as engine:
            completions = await _generate_group(engine, "abcab=", 8, temperature=temperature)
    # the 8 samples of one prompt were decoded together, in one batch
    assert engine.statistics().batches == 1
    prompt = list(TASK.tokenizer.encode("abcab="))
    seqs = [torch.tensor(prompt + c.tokens) for c in completions]
    recomputed = sequence_logprobs(model, seqs, temperature=temperature)
    assert len({tuple(c.tokens) for c in completions}) > 1  # really sampled
    for c, lp in zip(completions, recomputed, strict=True):
        assert c.policy_version == 0
        assert c.finish_reason == ("stop" if c.tokens[-1] == EOS else "length")
        assert len(c.logprobs) == len(c.tokens) > 0
        torch.testing.assert_close(torch.tensor(c.logprobs), lp[len(prompt) :], atol=1e-4, rtol=0)


async def test_same_seed_same_completion_whatever_the_batch() -> None:
    model = _model()
    with trio.fail_after(30):
        async with TorchEngine.open(model, eos_token_id=EOS, max_len=48) as engine:
            alone = await engine.generate(_request("abc=", seed=7))
            group = await _generate_group(engine, "abc=", 4)
            again = await engine.generate(_request("abc=", seed=7))
    assert alone.tokens == again.tokens
    assert len(group) == 4


class _SlowModel(torch.nn.Module):
    """Never ends a completion (eos is masked) and takes 20 ms per decode step."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        time.sleep(0.02)
        logits: torch.Tensor = self.inner(ids).clone()
        logits[..., EOS] = float("-inf")
        return logits


async def test_cancelling_a_request_stops_its_batch_between_decode_steps() -> None:
    slow = _SlowModel(_model(max_len=64))
    with trio.fail_after(30):
        async with TorchEngine.open(slow, eos_token_id=EOS, max_len=64) as engine:
            with trio.move_on_after(0.15) as scope:
                await engine.generate(_request("ab=", seed=1, max_tokens=50))
            assert scope.cancelled_caught
            while engine.statistics().running_batches:  # noqa: ASYNC110 - polling a counter
                await trio.sleep(0.01)
            stats = engine.statistics()
            # 50 steps would take a second; it stopped a few steps after the cancellation
            assert stats.abandoned == 1
            assert 1 <= stats.decode_steps <= 20, stats
            assert slow.calls == stats.decode_steps
            assert stats.completions == 0
            # the engine still serves other requests afterwards
            done = await engine.generate(_request("ab=", seed=2, max_tokens=3))
            assert len(done.tokens) == 3
            assert done.finish_reason == "length"


async def test_one_cancelled_row_leaves_the_rest_of_its_batch_running() -> None:
    slow = _SlowModel(_model(max_len=64))
    results: dict[int, Any] = {}

    async def one(engine: TorchEngine, i: int, cancel_after: float | None) -> None:
        with trio.move_on_after(cancel_after if cancel_after else 1e9):
            results[i] = await engine.generate(_request("ab=", i, max_tokens=10))

    with trio.fail_after(30):
        async with (
            TorchEngine.open(slow, eos_token_id=EOS, max_len=64) as engine,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(one, engine, 0, 0.06)
            nursery.start_soon(one, engine, 1, None)
            nursery.start_soon(one, engine, 2, None)
    assert sorted(results) == [1, 2]
    assert all(len(results[i].tokens) == 10 for i in (1, 2))
    assert engine.statistics().batches == 1


async def test_closing_the_engine_stops_generation_and_fails_pending_requests() -> None:
    slow = _SlowModel(_model(max_len=64))
    errors: list[BaseException] = []

    async def caller(engine: TorchEngine) -> None:
        try:
            await engine.generate(_request("ab=", seed=1, max_tokens=50))
        except trio.ClosedResourceError as exc:
            errors.append(exc)

    with trio.fail_after(30):
        async with (
            trio.open_nursery() as outer,
            TorchEngine.open(slow, eos_token_id=EOS, max_len=64) as engine,
        ):
            outer.start_soon(caller, engine)
            await trio.sleep(0.1)
            started = time.perf_counter()
    assert len(errors) == 1
    assert slow.calls < 20
    assert time.perf_counter() - started < 0.5
    with pytest.raises(trio.ClosedResourceError, match=r"outside TorchEngine\.open"):
        await engine.generate(_request("ab=", seed=1))


async def test_load_weights_swaps_the_model_and_bumps_the_version(tmp_path: Path) -> None:
    old, new = _model(seed=0), _model(seed=1)
    published = publish_weights(tmp_path / "weights", 3, new.state_dict(), keep=2)
    with trio.fail_after(30):
        async with TorchEngine.open(old, eos_token_id=EOS, max_len=48) as engine:
            before = await engine.generate(_request("abc=", seed=5))
            await engine.load_weights(published.path, 3)
            after = await engine.generate(_request("abc=", seed=5))
            assert engine.policy_version == 3
            assert engine.statistics().weight_loads == 1
            with pytest.raises(EngineError, match="nowhere"):
                await engine.load_weights(tmp_path / "nowhere", 4)
            with pytest.raises(ValueError, match="cannot go back"):
                await engine.load_weights(published.path, 2)
            assert engine.policy_version == 3
    assert before.policy_version == 0
    assert after.policy_version == 3
    for name, tensor in new.state_dict().items():
        torch.testing.assert_close(engine.model.state_dict()[name], tensor, atol=0, rtol=0)
    # the original model object was not mutated
    assert not torch.equal(old.head.weight, new.head.weight)
    prompt = list(TASK.tokenizer.encode("abc="))
    lp = sequence_logprobs(new, [torch.tensor(prompt + after.tokens)])[0]
    torch.testing.assert_close(torch.tensor(after.logprobs), lp[len(prompt) :], atol=1e-4, rtol=0)


async def test_a_prompt_too_long_for_the_model_is_refused() -> None:
    async with TorchEngine.open(_model(max_len=10), eos_token_id=EOS, max_len=10) as engine:
        with pytest.raises(EngineError, match="max_len 10"):
            await engine.generate(_request("abcde=", seed=1, max_tokens=7))


class _FixedModel(torch.nn.Module):
    """Every position predicts token 2 with p=0.6, token 3 with p=0.3, the rest share 0.1."""

    def __init__(self, vocab: int = 8) -> None:
        super().__init__()
        probs = torch.full((vocab,), 0.1 / (vocab - 2))
        probs[2], probs[3] = 0.6, 0.3
        self.logits = probs.log()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(ids.shape[0], ids.shape[1], -1).clone()


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.5, {2: 0.0}), (0.8, {2: math.log(0.6 / 0.9), 3: math.log(0.3 / 0.9)})],
)
async def test_top_p_samples_from_the_nucleus_and_reports_its_logprobs(
    top_p: float, expected: dict[int, float]
) -> None:
    with trio.fail_after(30):
        async with TorchEngine.open(_FixedModel(), eos_token_id=-1) as engine:
            done = await _generate_group(engine, "ab=", 8, max_tokens=20, top_p=top_p)
    seen = {t for c in done for t in c.tokens}
    assert seen == set(expected)
    for c in done:
        for token, lp in zip(c.tokens, c.logprobs, strict=True):
            assert lp == pytest.approx(expected[token], abs=1e-5)


async def test_an_aborted_row_returns_its_tokens_and_a_continuation_decodes_on() -> None:
    """Partial rollouts: the abort ends one row between decode steps with the tokens it has
    (finish reason ``abort``); its siblings run on; prompt + partial tokens continues it."""
    slow = _SlowModel(_model(max_len=64))
    signal = AbortSignal()
    results: dict[int, Any] = {}

    async def one(engine: TorchEngine, i: int, abort: AbortSignal | None) -> None:
        request = attrs.evolve(_request("ab=", i, max_tokens=40, temperature=0.0), abort=abort)
        results[i] = await engine.generate(request)

    with trio.fail_after(30):
        async with TorchEngine.open(slow, eos_token_id=EOS, max_len=64) as engine:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, engine, 0, signal)
                nursery.start_soon(one, engine, 1, None)
                await trio.sleep(0.1)
                signal.set()
            partial, whole = results[0], results[1]
            assert partial.finish_reason == "abort"
            assert 1 <= len(partial.tokens) < len(whole.tokens)
            assert len(partial.logprobs) == len(partial.tokens)
            # greedy: the same row decoded on from its partial output gives the whole answer
            prompt = TASK.tokenizer.encode("ab=")
            rest = await engine.generate(
                GenerateRequest(
                    prompt_tokens=tuple(prompt) + tuple(partial.tokens),
                    params=SamplingParams(max_tokens=40 - len(partial.tokens), temperature=0.0),
                )
            )
    assert partial.tokens + rest.tokens == whole.tokens
    assert rest.finish_reason == whole.finish_reason
    assert partial.logprobs + rest.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    # an abort set before the request arrives ends it with no tokens
    async with TorchEngine.open(_model(), eos_token_id=EOS, max_len=64) as engine:
        early = await engine.generate(attrs.evolve(_request("ab=", 5), abort=signal))
    assert early.finish_reason == "abort"
    assert early.tokens == []


async def test_occupancy_counts_the_rows_of_each_batch_over_its_decode_time() -> None:
    # one batch of 8 rows on an engine of 16 slots, then idle as long again: under a quarter
    with trio.fail_after(30):
        async with TorchEngine.open(_model(), eos_token_id=EOS, max_len=48, max_batch=16) as engine:
            assert engine.statistics().occupancy == 0.0  # no batch yet
            await _generate_group(engine, "abcab=", 8)
            busy = engine.statistics()
            assert busy.slots == 16
            assert busy.batches == 1
            assert 0 < busy.busy_row_seconds <= 8 * busy.elapsed
            assert busy.occupancy == pytest.approx(busy.busy_row_seconds / (16 * busy.elapsed))
            assert busy.occupancy <= 0.5
            await trio.sleep(busy.elapsed)
            idle = engine.statistics()
    assert idle.busy_row_seconds == busy.busy_row_seconds  # nothing ran meanwhile
    assert idle.occupancy < busy.occupancy / 1.5
