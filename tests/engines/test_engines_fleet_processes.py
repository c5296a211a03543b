"""The inference fleet with its servers as separate processes (``vllm_stand_in.py`` run as a
program on loopback): a run whose server is killed with SIGKILL mid-run completes, its samples
retried on the other server and counted, and the restarted server is taken back in only once it
has loaded the current weights. Also: launched servers are process groups the run owns."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from operations_waits import documented
from trio_rl.config import LearnRunConfig, load
from trio_rl.engines import (
    EngineConfigError,
    EngineFleet,
    EngineTimeoutError,
    EngineTransportError,
    GenerateRequest,
    SamplingParams,
    launch_vllm_servers,
    open_engine_fleet,
    open_inference,
    run_vllm_server,
)
from trio_rl.engines._launch import free_port
from trio_rl.errors import collapse_single
from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
from trio_rl.rollout import InMemorySource, RolloutConfig
from trio_rl.samples import Prompt, Sample
from trio_rl.transport import FileReceiver, FileSender
from trio_rl.wire import decode

STAND_IN = str(Path(__file__).with_name("vllm_stand_in.py"))
STEPS = 10
BATCH_GROUPS, GROUP_SIZE = 2, 4


def _reward(sample: Sample) -> float:
    return float(sample.index % 3)


async def _start_stand_in(nursery: trio.Nursery, port: int, *extra: str) -> trio.Process:
    cmd = [sys.executable, STAND_IN, "--port", str(port), "--step-delay", "0.03", *extra]
    process: trio.Process = await nursery.start(partial(trio.run_process, cmd, check=False))
    url = f"http://127.0.0.1:{port}"
    with trio.fail_after(20):
        while True:
            try:
                async with httpx.AsyncClient() as client:
                    if (await client.get(url + "/health")).status_code == 200:
                        return process
            except httpx.TransportError:
                await trio.sleep(0.05)


async def _log(url: str) -> list[dict[str, Any]]:
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client:
            response = await client.get(url + "/stand_in/log")
    data: list[dict[str, Any]] = response.json()
    return data


async def _trainer(
    out: Path,
    fleet: EngineFleet,
    trained: list[tuple[int, ...]],
    shipped: list[int],
    weights: Path,
) -> None:
    """Reads every batch, records its sequences (a group's prompt is its own, and the stand-in
    answers each seed differently: a sequence names its sample), acknowledges it, then loads
    version ``step`` into the fleet (as a trainer's publication and the weight watcher
    would)."""
    async with FileReceiver(out, 0, start_step=1, delete=True, poll_interval=0.01) as receiver:
        for _ in range(STEPS):
            got = await receiver.receive()
            batches = decode(got.data)
            for mb in batches:
                start = 0
                for length in mb.sequence_lengths:
                    trained.append(tuple(mb.input_ids[start : start + length]))
                    start += length
            await receiver.ack(got.step)
            shipped.append(got.step)
            await fleet.load_weights(weights / f"step_{got.step}", got.step)


async def test_a_run_survives_a_server_killed_with_sigkill_and_takes_it_back(
    tmp_path: Path,
) -> None:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    config = OrchestratorConfig(
        batch_groups=BATCH_GROUPS,
        group_size=GROUP_SIZE,
        max_async_level=1,
        sampling=SamplingParams(max_tokens=8),
        seed=3,
        rollout=RolloutConfig(routing_keys="group"),
    )
    prompts = [Prompt(key=f"p{i}", tokens=(10_000 + i, 2)) for i in range(200)]
    trained: list[tuple[int, ...]] = []
    shipped: list[int] = []
    timeline: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as servers:
            victim = await _start_stand_in(servers, ports[0])
            await _start_stand_in(servers, ports[1])
            sender = FileSender(tmp_path, 1)
            async with (
                open_engine_fleet(urls, probe_interval=0.1, probe_timeout=2.0) as fleet,
                sender,
                open_orchestrator(
                    fleet,
                    InMemorySource(prompts),
                    sender,
                    config=config,
                    sample_reward=_reward,
                    version=fleet.version,
                ) as orch,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(_trainer, tmp_path, fleet, trained, shipped, tmp_path / "w")

                async def chaos() -> None:
                    # no event marks "requests in flight on it": poll
                    while len(shipped) < 2 or fleet.servers()[0].in_flight == 0:  # noqa: ASYNC110
                        await trio.sleep(0.01)
                    in_flight = fleet.servers()[0].in_flight
                    victim.kill()  # SIGKILL: no goodbye, connections reset mid-stream
                    timeline.append(f"killed {urls[0]} with {in_flight} requests in flight")
                    await fleet.wait_live([urls[1]], timeout=20)
                    await _start_stand_in(servers, ports[0])
                    timeline.append(f"restarted {urls[0]} at version {fleet.version.value}")
                    await fleet.wait_live(urls, timeout=20)
                    timeline.append(f"{urls[0]} back in at version {fleet.version.value}")

                nursery.start_soon(chaos)
                summary = await orch.run(STEPS)
                with trio.fail_after(20):
                    await fleet.version.wait_at_least(STEPS)  # the trainer's last load
                stats = fleet.statistics()
                status = fleet.servers()
                events = fleet.events()
                restarted_log = await _log(urls[0])
                nursery.cancel_scope.cancel()
            servers.cancel_scope.cancel()
    print("\n".join(timeline))
    print(json.dumps(stats))
    # the run completed, every shipped sample trained exactly once
    assert shipped == list(range(1, STEPS + 1))
    assert summary.last_step == STEPS
    assert len(trained) == STEPS * BATCH_GROUPS * GROUP_SIZE
    assert len(set(trained)) == len(trained)
    # the killed server's requests were retried on the other one, and counted
    assert stats["taken_out"] == 1
    assert stats["taken_in"] == 1
    assert stats["retried"] >= 1
    assert stats["retried"] == status[0].failures
    assert stats["failed"] == 0
    assert summary.counters.failed == 0
    # the restarted server loaded the current weights before it took a request ...
    served = [r["path"] for r in restarted_log if r["path"] != "/health"]
    assert served[:2] == ["/collective_rpc", "/reset_prefix_cache"]
    first_reload = next(r for r in restarted_log if r["path"] == "/collective_rpc")
    back_in = next(e for e in events if e.url == urls[0] and e.kind == "in")
    loaded_before = [
        e.version for e in events if e.kind == "loaded" and e.url == urls[1] and e.at <= back_in.at
    ]
    assert back_in.version == max(v for v in loaded_before if v is not None)
    assert first_reload["body"]["kwargs"]["weights_path"] == str(
        tmp_path / "w" / f"step_{back_in.version}"
    )
    # ... and is back in rotation, serving the current version
    assert "/v1/completions" in served
    assert status[0].state == "live"
    assert status[0].loaded_version == fleet.version.value == STEPS


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(")")[1].split()[1])


async def _until_gone(pid: int) -> None:
    with trio.fail_after(5):
        while _alive(pid):  # noqa: ASYNC110 - no event marks another process's exit
            await trio.sleep(0.05)


def _child_pid(log: Path) -> int:
    for line in log.read_text().splitlines():
        if line.startswith("child "):
            return int(line.split()[1])
    raise AssertionError(f"no child pid in {log}: {log.read_text()!r}")


STAND_IN_VLLM = (sys.executable, STAND_IN)


async def test_launched_servers_are_stopped_with_their_children(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with launch_vllm_servers(
            2, "/models/tiny", executable=STAND_IN_VLLM, args=["--child"], log_dir=tmp_path
        ) as launched:
            urls = launched.urls
            async with open_engine_fleet(
                urls, probe_interval=0.1, headers=launched.headers
            ) as fleet:
                assert sorted(fleet.live()) == sorted(urls)
            children = [_child_pid(tmp_path / f"vllm-{i}.log") for i in range(2)]
            assert all(_alive(pid) for pid in children)
    for pid in children:
        await _until_gone(pid)


async def test_a_launched_server_that_dies_is_restarted_and_taken_back_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.engines")
    with trio.fail_after(60):
        async with (
            launch_vllm_servers(
                2, "/models/tiny", executable=STAND_IN_VLLM, args=["--child"], log_dir=tmp_path
            ) as launched,
            open_engine_fleet(launched.urls, probe_interval=0.1, headers=launched.headers) as fleet,
        ):
            launched.on_exit = fleet.take_out
            urls = launched.urls
            await fleet.load_weights("/w/1", 1)
            log = tmp_path / "vllm-0.log"
            first_child = _child_pid(log)
            # the server process (the child's parent) is killed with SIGKILL
            parent = _parent(first_child)
            os.kill(parent, signal.SIGKILL)
            with trio.fail_after(30):  # restarted on its port, reloaded, back in
                while fleet.statistics()["taken_in"] < 1:  # noqa: ASYNC110 - polls a counter
                    await trio.sleep(0.05)
            assert fleet.live() == urls
            assert [(e.url, e.kind, e.version) for e in fleet.events()][-3:] == [
                (urls[0], "out", None),
                (urls[0], "loaded", 1),
                (urls[0], "in", 1),
            ]
            assert launched.restarts == {urls[0]: 1}
            (restart,) = [r.getMessage() for r in caplog.records if "restarting" in r.getMessage()]
            assert restart.startswith(f"vllm server {urls[0]} (")
            assert restart.endswith(f", log {log} exited with code -9; restarting it (1 of 3)"), (
                restart
            )
            documented("a launched server that exits", restart)
            assert fleet.servers()[0].loaded_version == 1
            await _until_gone(first_child)  # the dead server's process group went with it


async def _kill_and_wait(log: Path) -> None:
    """Kill the server whose log is ``log`` with SIGKILL, then wait for what that ends."""
    os.kill(_parent(_child_pid(log)), signal.SIGKILL)
    await trio.sleep_forever()


async def test_a_server_that_exits_once_its_restarts_are_spent_ends_the_launch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.engines")
    with (
        trio.fail_after(30),
        pytest.raises(EngineTransportError, match="exited with code -9") as info,
        collapse_single(),
    ):
        async with launch_vllm_servers(
            1,
            "/models/tiny",
            executable=STAND_IN_VLLM,
            args=["--child"],
            log_dir=tmp_path,
            restarts=0,
        ) as launched:
            await _kill_and_wait(tmp_path / "vllm-0.log")
    assert launched.urls[0] in str(info.value)
    assert launched.restarts == {}
    assert not [r for r in caplog.records if "restarting" in r.getMessage()]


async def test_a_server_that_never_answers_fails_the_launch_and_is_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.engines")
    log = tmp_path / "slow.log"
    port = free_port()
    with (
        trio.fail_after(30),
        pytest.raises(EngineTimeoutError, match="did not answer /health"),
        collapse_single(),
    ):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                partial(
                    run_vllm_server,
                    "/models/tiny",
                    port,
                    api_key="k",
                    executable=STAND_IN_VLLM,
                    args=["--child", "--start-delay", "30"],
                    log=log,
                    start_timeout=1.0,
                    grace=1.0,
                )
            )
    await _until_gone(_child_pid(log))
    # said at once, naming the command and its log, with the time left
    first = next(r.getMessage() for r in caplog.records if "waiting for" in r.getMessage())
    assert first.startswith(f"waiting for vllm server http://127.0.0.1:{port} ({sys.executable} ")
    assert f"), log {log} (" in first
    assert re.search(r"1 attempt\), giving up in [01] s$", first), first
    documented("launched vLLM servers", first)


async def test_a_server_that_exits_at_start_is_an_error_naming_it(tmp_path: Path) -> None:
    with (
        trio.fail_after(30),
        pytest.raises(EngineTransportError, match="exited with code 2"),
        collapse_single(),
    ):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                partial(
                    run_vllm_server,
                    "/models/tiny",
                    free_port(),
                    api_key="k",
                    executable=STAND_IN_VLLM,
                    args=["--no-such-flag"],
                    log=tmp_path / "bad.log",
                )
            )


async def test_open_inference_launches_the_servers_the_configuration_asks_for(
    tmp_path: Path,
) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[inference]\n"
        "launch = 2\n"
        f"vllm = {json.dumps(f'{sys.executable} {STAND_IN}')}\n"
        'vllm_args = ["--child"]\n'
        'served_name = "tiny"\n'
        "start_timeout = 30\n"
        "probe_interval = 0.1\n"
    )
    config, _ = load(LearnRunConfig, [toml])
    assert config.inference.routing_keys == "group"
    with trio.fail_after(60):
        async with open_inference(
            **attrs.asdict(config.inference.fleet_config(), recurse=False),
            model_path="/models/tiny",
            log_dir=tmp_path,
        ) as fleet:
            assert len(fleet.live()) == 2
            assert fleet.model == "tiny"  # the servers were started with that name
            done = await fleet.generate(GenerateRequest((5, 6), SamplingParams(max_tokens=4)))
            assert done.finish_reason == "stop"
            children = [_child_pid(tmp_path / f"vllm-{i}.log") for i in range(2)]
    for pid in children:
        await _until_gone(pid)


async def test_open_inference_over_running_servers_and_its_bad_input(tmp_path: Path) -> None:
    port = free_port()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await _start_stand_in(nursery, port)
            url = f"http://127.0.0.1:{port}"
            async with open_inference(urls=[url], probe_interval=0.1) as fleet:
                assert fleet.live() == [url]
                assert fleet.model == "stand-in"  # what the server lists
            with pytest.raises(EngineConfigError, match="exactly one of them"):
                async with open_inference(urls=[url], launch=1):
                    pass
            with pytest.raises(EngineConfigError, match="needs model_path"):
                async with open_inference(launch=1):
                    pass
            nursery.cancel_scope.cancel()
