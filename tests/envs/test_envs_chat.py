"""Chat models: a message is rendered alone with the chat template (the earlier turns are never
re-tokenized), the template's boundary tokens are kept, and a template that rewrites earlier
turns is detected: fail or drop, counted."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pytest
import trio

from trio_rl.engines import Completion, GenerateRequest, SamplingParams
from trio_rl.envs import (
    ChatTemplate,
    EnvConfig,
    EpisodeRunner,
    HermesCalls,
    TemplateMismatchError,
    ToolCall,
    ToolEnv,
)
from trio_rl.samples import Sample, SampleStatus

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<pad>", "<|end|>", "<|user|>", "<|assistant|>", "<|tool|>"]
CHARS = 'abcdefghijklmnopqrstuvwxyz0123456789 {}:"_,<>/=+\n'
# every message as <|role|>content<|end|> then a newline (the newline is the template's: it
# follows the end of turn the policy samples)
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# a template that shortens every earlier assistant turn to its first character (as some
# reasoning templates drop earlier thinking)
REWRITING = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'][:1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer(template: str) -> Any:
    vocab = {t: i for i, t in enumerate(SPECIALS)} | {
        c: len(SPECIALS) + i for i, c in enumerate(CHARS)
    }
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    core.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<|end|>",
        unk_token="<pad>",
        additional_special_tokens=SPECIALS[2:],
    )
    fast.chat_template = template
    return fast


@attrs.define(eq=False)
class ChatPolicy:
    """Answers with a tool call first, then with the tool's result; ends each turn with the
    end-of-turn token. Keeps every prompt it got."""

    tokenizer: Any
    prompts: list[tuple[int, ...]] = attrs.field(factory=list)

    async def generate(self, request: GenerateRequest) -> Completion:
        self.prompts.append(request.prompt_tokens)
        seen = self.tokenizer.decode(list(request.prompt_tokens))
        if "<|tool|>" not in seen:
            text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        else:
            text = "it is " + seen.split("<|tool|>")[-1].split("<|end|>")[0]
        tokens = [
            *self.tokenizer.encode(text, add_special_tokens=False),
            self.tokenizer.eos_token_id,
        ]
        return Completion(tokens, [-0.5] * len(tokens), "stop", 0)


def add(a: int, b: int) -> str:
    return json.dumps(a + b)


def reward(record: Mapping[str, Any], answer: str, calls: Sequence[ToolCall]) -> float:
    return float(answer.strip() == "it is 5")


async def _run(
    template: str, on_mismatch: str = "fail"
) -> tuple[Sample, EpisodeRunner, Any, ChatPolicy]:
    tokenizer = _tokenizer(template)
    chat = ChatTemplate(tokenizer)
    policy = ChatPolicy(tokenizer)
    messages = [{"role": "user", "content": "what is 2+3"}]
    prompt = tuple(
        tokenizer.encode(
            chat.render(messages, add_generation_prompt=True), add_special_tokens=False
        )
    )
    runner = EpisodeRunner(
        policy,
        ToolEnv([add], reward, syntax=HermesCalls()),
        chat,
        SamplingParams(max_tokens=80),
        EnvConfig(on_mismatch=on_mismatch),  # type: ignore[arg-type]
        chat=chat,
    )
    sample = Sample(0, 0, prompt, label={"messages": messages})
    with trio.fail_after(10):
        await runner(sample)
    return sample, runner, tokenizer, policy


async def test_a_tool_result_is_one_rendered_message_and_the_boundary_is_the_templates() -> None:
    sample, runner, tokenizer, policy = await _run(TEMPLATE)
    assert sample.status is SampleStatus.COMPLETED
    assert sample.reward == 1.0
    tokens = sample.prompt_tokens + tuple(sample.completion_tokens)
    # the episode's tokens are the template's rendering of the whole conversation, up to the
    # newline after the last end of turn (the next turn would add it)
    conversation = [
        {"role": "user", "content": "what is 2+3"},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "it is 5"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokens == tuple(tokenizer.encode(rendered.removesuffix("\n"), add_special_tokens=False))
    # the newline after the policy's end of turn is the environment's, never trained
    end = tokenizer.eos_token_id
    first_end = sample.completion_tokens.index(end)
    assert sample.loss_mask[first_end] is True
    assert sample.loss_mask[first_end + 1] is False
    assert tokenizer.decode([sample.completion_tokens[first_end + 1]]) == "\n"
    # mask True exactly on the two turns the policy sampled
    sampled = [t for t, m in zip(sample.completion_tokens, sample.loss_mask, strict=True) if m]
    assert tokenizer.decode(sampled).count("<|end|>") == 2
    for prompt in policy.prompts:
        assert tokens[: len(prompt)] == prompt
    assert runner.stats.mismatches == 0


async def test_a_template_that_rewrites_earlier_turns_fails_the_episode_loudly() -> None:
    with pytest.raises(TemplateMismatchError, match="rewrites"):
        await _run(REWRITING, "fail")


async def test_a_template_that_rewrites_earlier_turns_trains_nothing_with_drop() -> None:
    sample, runner, _, _ = await _run(REWRITING, "drop")
    assert runner.stats.mismatches == 1
    assert not any(sample.loss_mask)
    assert sample.completion_tokens  # kept for the record, never trained


async def test_observe_message_needs_a_chat_template() -> None:
    from envs_helpers import CODEC, ScriptedPolicy

    from trio_rl.envs import Episode

    seen: list[str] = []

    async def env(episode: Episode, record: Mapping[str, Any]) -> float:
        await episode.generate()
        try:
            episode.observe_message("tool", "x")
        except ValueError as exc:
            seen.append(str(exc))
        return 1.0

    await EpisodeRunner(ScriptedPolicy(lambda p: "a"), env, CODEC)(
        Sample(0, 0, CODEC.encode("1="), label={})
    )
    assert seen
    assert "needs a chat template" in seen[0]
