"""A multi-turn episode through the training path with real tensors: the scoring, packing and
wire path carry its loss mask exactly, and the reference trainer's loss has zero gradient on
every masked (observed) token."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import trio

from trio_rl.engines import SamplingParams, TorchEngine
from trio_rl.envs import EnvConfig, EnvFn, Episode, EpisodeRunner
from trio_rl.learn import TASKS, CharTransformer, ModelConfig
from trio_rl.learn._grpo import grpo_token_terms
from trio_rl.learn._model import sequence_logprobs
from trio_rl.learn.tasks import lookup, task_records
from trio_rl.publish import pack_samples
from trio_rl.samples import Sample
from trio_rl.sink import to_training_sample
from trio_rl.trainer import to_torch
from trio_rl.wire import MicroBatch, decode, encode

torch.set_num_threads(1)
TASK = TASKS["lookup"]
MAX_LEN = TASK.max_prompt + TASK.max_answer + 1


def _model(seed: int = 0) -> CharTransformer:
    torch.manual_seed(seed)
    model = CharTransformer(ModelConfig(TASK.tokenizer.vocab_size, max_len=MAX_LEN))
    torch.nn.init.normal_(model.head.weight, std=0.5)
    return model


class _Recording:
    def __init__(self, inner: TorchEngine) -> None:
        self.inner = inner
        self.prompts: list[tuple[int, ...]] = []

    async def generate(self, request):  # type: ignore[no-untyped-def]
        self.prompts.append(request.prompt_tokens)
        return await self.inner.generate(request)


async def _observing(episode: Episode, record: Mapping[str, Any]) -> float:
    """Two policy turns around an observation: masked tokens in every episode."""
    await episode.generate(max_tokens=2)
    episode.observe("ab=")
    await episode.generate(max_tokens=2)
    return 1.0


async def _episodes(
    model: CharTransformer, n: int, env: EnvFn = lookup
) -> tuple[list[Sample], list[tuple[int, ...]]]:
    codec = TASK.tokenizer
    records = task_records("lookup", n, seed=3)
    # a policy that calls with the prompt's key often enough: sample at a high temperature
    async with TorchEngine.open(
        model.eval(), eos_token_id=1, max_len=MAX_LEN, seed=0
    ) as torch_engine:
        engine = _Recording(torch_engine)
        runner = EpisodeRunner(
            engine,
            env,
            codec,
            SamplingParams(max_tokens=TASK.max_answer + 1),
            EnvConfig(max_turns=2),
            max_len=MAX_LEN,
        )
        samples = [
            Sample(i, 0, codec.encode(r["prompt"]), label=r, seed=100 + i)
            for i, r in enumerate(records)
        ]
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for s in samples:
                    nursery.start_soon(runner, s)
    return samples, engine.prompts


async def test_torch_engine_episodes_keep_the_prefix_property_and_exact_logprobs() -> None:
    model = _model()
    samples, prompts = await _episodes(model, 16, _observing)
    finals = [s.prompt_tokens + tuple(s.completion_tokens) for s in samples]
    for prompt in prompts:
        assert any(f[: len(prompt)] == prompt for f in finals)
    two_turns = [s for s in samples if len(s.policy_versions) == 2]
    assert len(two_turns) == len(samples)
    for s in two_turns:
        seq = torch.tensor(s.prompt_tokens + tuple(s.completion_tokens))
        recomputed = sequence_logprobs(model, [seq])[0][len(s.prompt_tokens) :]
        for i, (mask, lp) in enumerate(zip(s.loss_mask, s.logprobs, strict=True)):
            if mask:  # what the engine sampled: its logprob under the model
                assert abs(recomputed[i].item() - lp) < 1e-4
            else:  # what the environment said
                assert lp == 0.0


def _micro_batch(samples: list[Sample]) -> MicroBatch:
    training = [
        to_training_sample(
            s, 1.0 if i % 2 else -1.0, temperature=1.0, group_id="g", version=0, arrival=i
        )
        for i, s in enumerate(samples)
    ]
    [[mb]] = pack_samples(training, seq_len=1024)
    [decoded] = decode(encode([mb]))
    return decoded


async def test_the_wire_carries_the_episodes_exact_mask() -> None:
    samples, _ = await _episodes(_model(), 8, _observing)
    mb = _micro_batch(samples)
    expected = [m for s in samples for m in [False] * len(s.prompt_tokens) + list(s.loss_mask)]
    # first-fit-decreasing may reorder the samples: compare as a multiset of sequences
    got, start = [], 0
    for length in mb.seq_lens:
        got.append(tuple(mb.loss_mask[start : start + length]))
        start += length
    want = sorted(tuple([False] * len(s.prompt_tokens) + list(s.loss_mask)) for s in samples)
    assert sorted(got) == want
    assert sum(mb.loss_mask) == sum(expected)
    for m, lp in zip(mb.loss_mask, mb.inference_logprobs, strict=True):
        if not m:
            assert lp == 0.0


async def test_the_trainers_loss_has_zero_gradient_on_masked_tokens() -> None:
    model = _model()
    samples, _ = await _episodes(model, 8, _observing)
    assert all(not all(s.loss_mask) for s in samples)
    tensors = to_torch(_micro_batch(samples))
    model.train()
    captured: list[torch.Tensor] = []

    def keep(_: torch.nn.Module, __: object, out: torch.Tensor) -> None:
        out.retain_grad()
        captured.append(out)

    handle = model.head.register_forward_hook(keep)
    try:
        losses, *_ = grpo_token_terms(model, tensors, clip=0.2)
        losses.sum().backward()  # type: ignore[no-untyped-call]
    finally:
        handle.remove()
    # one temperature: the sequences were scored as one padded batch [n, longest, vocab]
    [logits] = captured
    grad = logits.grad
    assert grad is not None
    mask = tensors.loss_mask[0]
    # the logits at position t score token t + 1 of the same sequence: a token's gradient
    # lives on its predecessor's logits
    start, checked = 0, 0
    for b, length in enumerate(tensors.seq_lens.tolist()):
        for t in range(1, length):
            if not mask[start + t]:
                assert torch.count_nonzero(grad[b, t - 1]) == 0
                checked += 1
        start += length
    assert checked > 0
    assert torch.count_nonzero(grad) > 0  # the sampled tokens do get a gradient


async def test_masked_advantages_and_logprobs_do_not_move_the_gradient() -> None:
    model = _model()
    samples, _ = await _episodes(model, 8, _observing)
    tensors = to_torch(_micro_batch(samples))
    model.train()

    def grads(t: object) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        losses, *_ = grpo_token_terms(model, t, clip=0.2)  # type: ignore[arg-type]
        losses.sum().backward()  # type: ignore[no-untyped-call]
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    before = grads(tensors)
    masked = ~tensors.loss_mask
    tensors.advantages[masked] = 1e6
    tensors.inference_logprobs[masked] = -1e6
    after = grads(tensors)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
