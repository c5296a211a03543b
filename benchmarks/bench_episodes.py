"""Multi-turn episodes: CPU per turn against single-turn samples, and memory per episode.

    python benchmarks/bench_episodes.py [--sizes 1000,10000] [--memory 1000,5000,10000]
                                        [--turns 4] [--tokens 64] [--repeat 3]

Part A (CPU). N episodes run concurrently, each a ``ToolEnv`` of ``turns`` policy turns of
``tokens`` sampled tokens with an async tool call (its result observed) between two turns,
played by ``EpisodeRunner`` (one ``ToolEnv`` shared by every episode, as a user's module-level
environment is; its reward is async, so scoring costs no worker thread: the comparator scores
nothing). The runner is opened, as the learning run opens it (its task serves every tool
call's deadline, the default ``tool_timeout``); the episodes have no ``episode_timeout`` (the
run's default, 600 s, nests every wait of an episode under one more cancel scope: about
0.15x more at 10,000 episodes, docs/benchmarks.md). Each turn's request carries the episode's whole prefix, as it must. The comparator
is the same number of engine requests and sampled tokens as single-turn samples
(``engine_generate``): ``turns * N`` samples of ``tokens`` tokens. A second comparator, ``N``
samples of ``turns * tokens`` tokens, is the same tokens in as many samples as episodes. The
engine answers every request after the same virtual-free delay (a real ``trio.sleep``), so
every run keeps its N in flight at once; the figure is the process CPU time over the turns (or
samples) played, and the part of it the garbage collector took (``gc.callbacks``). Each size
runs ``--repeat`` times, the sides interleaved (episodes, then the comparators, then again),
so a load change on the shared machine hits them alike: the figures are the medians, the ratio
the median of each repetition's own ratio. Goal: per-turn overhead <= 1.3x (printed as a ratio
from this run, not asserted).

The goal's tool yields once (``trio.sleep(0)``), as an async tool that does any I/O does. For
where a turn's CPU goes, the same episodes also run with a tool that returns at once (printed
below the figures, not the goal): the difference is the tool's own trip through the scheduler
and the collector's work on everything an episode holds while it waits there.

Both sides' tasks are spawned with a name, as the group runner spawns its sample tasks: without
one trio names a task by ``repr`` of its function, and the repr of an ``EpisodeRunner`` (an
attrs repr of the engine, the environment, the settings) cost ~10 us an episode that the
comparator's plain function, and a real run, never pay.

Part B (memory). ``tracemalloc``'s peak while N episodes are in flight, divided by N, at each
of ``--memory``: linear growth is a constant bytes per episode.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import trio

from trio_rl.engines import Completion, GenerateRequest
from trio_rl.envs import EnvConfig, Episode, EpisodeRunner, ToolCall, ToolEnv
from trio_rl.rollout import GenerateFn, engine_generate
from trio_rl.samples import Sample


class _Engine:
    """Answers every request with ``tokens`` tokens after ``delay`` seconds; the ``turns``-th
    request of a routing key (an episode's last turn) is the answer, token 1 first."""

    def __init__(self, tokens: int, delay: float, turns: int = 0) -> None:
        self.tokens, self.delay, self.turns = tokens, delay, turns
        self.requests = 0
        self.seen: dict[str | None, int] = {}  # both sides pay this lookup

    async def generate(self, request: GenerateRequest) -> Completion:
        self.requests += 1
        turn = self.seen.get(request.routing_key, 0) + 1
        self.seen[request.routing_key] = turn
        await trio.sleep(self.delay)
        first = 1 if turn == self.turns else 0
        n = self.tokens
        return Completion(
            tokens=list(range(first, first + n)),
            logprobs=[-0.5] * n,
            finish_reason="stop",
            policy_version=0,
        )


class _Codec:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 128 for c in text]

    def decode(self, tokens: Sequence[int]) -> str:
        return "answer" if tokens[0] == 1 else "call"


class _Calls:
    """The policy calls the tool ``name`` until the engine gives its answer."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> list[ToolCall]:
        return [] if text == "answer" else [ToolCall(self.name)]

    def show(self, episode: Episode, call: ToolCall, result: str) -> None:
        episode.observe(result)

    def show_error(self, episode: Episode, message: str) -> None:
        episode.observe("!")


async def lookup() -> str:
    await trio.sleep(0)
    return "value=42;"


async def lookup_at_once() -> str:
    """The same tool without its checkpoint: it never gives the loop back (a reference line,
    not the goal's workload)."""
    return "value=42;"


async def _reward(record: Mapping[str, Any], text: str, calls: Sequence[ToolCall]) -> float:
    # async, so it runs on the loop: the single-turn comparator scores nothing, and a plain
    # reward would add a worker-thread round trip per episode that it does not pay
    return float(len(calls))


def _env(turns: int, tool: Callable[[], Awaitable[str]] = lookup) -> ToolEnv:
    # built once and shared by every episode, as a user's module-level environment is
    return ToolEnv([tool], _reward, max_turns=turns + 1, syntax=_Calls(tool.__name__))


#: the name of every task, as the group runner names its sample tasks (see the docstring)
_TASK = "bench_episodes.sample"


async def _run_all(generate: GenerateFn, n: int, prompt: int, probe: Any = None) -> None:
    samples = [Sample(index=i, group_index=i, prompt_tokens=tuple(range(prompt))) for i in range(n)]
    # an EpisodeRunner is opened, as the learning run opens it: its task serves the deadlines
    opened = generate if isinstance(generate, EpisodeRunner) else contextlib.nullcontext()
    async with opened, trio.open_nursery() as nursery:
        for sample in samples:
            nursery.start_soon(generate, sample, name=_TASK)
        if probe is not None:
            nursery.start_soon(probe)


class _GcClock:
    """Process CPU seconds the garbage collector took, summed over its collections."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.total += time.process_time() - self._start


def _cpu(generate_of: Any, n: int, prompt: int) -> tuple[float, float]:
    """Process CPU seconds of one run of ``n`` concurrent generate calls, and the collector's
    share of them."""
    gc.collect()
    clock = _GcClock()
    gc.callbacks.append(clock)
    try:
        t0 = time.process_time()
        trio.run(_run_all, generate_of(), n, prompt)
        return time.process_time() - t0, clock.total
    finally:
        gc.callbacks.remove(clock)


def part_a(
    sizes: list[int], turns: int, tokens: int, delay: float, prompt: int, repeat: int
) -> None:
    print(
        f"A. CPU per turn: {turns}-turn episodes of {tokens} tokens a turn, tool between turns; "
        f"medians of {repeat} interleaved repetitions (GC: the collector's part)"
    )
    for n in sizes:
        runs: dict[str, list[tuple[float, float]]] = {
            "ep": [],
            "at_once": [],
            "turn": [],
            "sample": [],
        }
        for _ in range(repeat):
            for side, tool in (("ep", lookup), ("at_once", lookup_at_once)):
                runs[side].append(
                    _cpu(
                        lambda tool=tool: EpisodeRunner(
                            _Engine(tokens, delay, turns),
                            _env(turns, tool),
                            _Codec(),
                            config=EnvConfig(max_turns=turns, episode_timeout=None),
                            max_len=1 << 20,
                        ),
                        n,
                        prompt,
                    )
                )
            runs["turn"].append(
                _cpu(lambda: engine_generate(_Engine(tokens, delay)), n * turns, prompt)
            )
            runs["sample"].append(
                _cpu(lambda: engine_generate(_Engine(tokens * turns, delay)), n, prompt)
            )
        # per turn (episodes, samples of one turn's tokens) or per sample (of all the tokens)
        per = {"ep": n * turns, "at_once": n * turns, "turn": n * turns, "sample": n}

        us = {
            (side, part): statistics.median(run[part] for run in runs[side]) / per[side] * 1e6
            for side in runs
            for part in (0, 1)
        }

        ratios = [ep[0] / st[0] for ep, st in zip(runs["ep"], runs["turn"], strict=True)]
        episode_ratios = [
            ep[0] / one[0] for ep, one in zip(runs["ep"], runs["sample"], strict=True)
        ]
        ratio, episode_ratio = statistics.median(ratios), statistics.median(episode_ratios)
        at_once = statistics.median(
            ep[0] / st[0] for ep, st in zip(runs["at_once"], runs["turn"], strict=True)
        )
        print(
            f"  {n:>6} episodes in flight: {us['ep', 0]:7.1f} us CPU per turn "
            f"(GC {us['ep', 1]:5.1f}); single-turn samples of {tokens} tokens x{n * turns}: "
            f"{us['turn', 0]:7.1f} us per sample (GC {us['turn', 1]:5.1f}); of {tokens * turns} "
            f"tokens x{n}: {us['sample', 0]:7.1f} us per sample (GC {us['sample', 1]:5.1f}); "
            f"per-turn ratios {' '.join(f'{r:.2f}' for r in ratios)}"
        )
        print(
            f"  the same episodes with a tool that never yields (no checkpoint between two "
            f"turns): {us['at_once', 0]:7.1f} us per turn (GC {us['at_once', 1]:5.1f}), "
            f"{at_once:.2f}x a single-turn sample"
        )
        print(
            f"goal 7: per-turn overhead at {n} episodes: {ratio:.2f}x the CPU of a "
            f"single-turn sample of the same tokens (goal <= 1.3x; median of {repeat}); an "
            f"episode costs {episode_ratio:.2f}x one sample of all its tokens"
        )


def part_b(sizes: list[int], turns: int, tokens: int, delay: float, prompt: int) -> None:
    print("B. memory: tracemalloc peak while N episodes are in flight, per episode")
    per: list[float] = []
    for n in sizes:
        gc.collect()
        tracemalloc.start()
        runner = EpisodeRunner(
            _Engine(tokens, delay, turns),
            _env(turns),
            _Codec(),
            config=EnvConfig(max_turns=turns, episode_timeout=None),
            max_len=1 << 20,
        )
        base = tracemalloc.get_traced_memory()[0]
        trio.run(_run_all, runner, n, prompt)
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        per.append(peak / n)
        print(f"  {n:>6} episodes: peak {peak / 2**20:8.1f} MiB, {peak / n:8.0f} bytes per episode")
    if len(per) > 1:
        print(
            f"goal 8: bytes per episode from {sizes[0]} to {sizes[-1]} episodes: "
            f"{per[-1] / per[0]:.2f}x (linear growth: ~1.0x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000", help="episodes in flight (part A)")
    parser.add_argument("--memory", default="1000,5000,10000", help="episodes (part B)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="sampled tokens per turn")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--delay", type=float, default=0.05, help="engine seconds per request")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs per size (part A)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    memory = [int(s) for s in args.memory.split(",") if s]
    part_a(sizes, args.turns, args.tokens, args.delay, args.prompt, args.repeat)
    part_b(memory, args.turns, args.tokens, args.delay, args.prompt)


if __name__ == "__main__":
    main()
