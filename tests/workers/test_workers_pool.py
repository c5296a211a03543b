"""The worker pool: user code in real worker processes that a timeout or a cancellation kills,
whose failures come back as one error naming the exception and the call, and of which none is
left once the pool's block ended, however it ended (even when its parent is SIGKILLed)."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
import trio

from operations_waits import documented
from trio_rl.workers import (
    WorkerCallError,
    WorkerDiedError,
    WorkerPool,
    WorkerStartError,
    WorkerTimeoutError,
    open_worker_pool,
)

USER_CODE = """
import os, time

def pid(x):
    return os.getpid()

def sleep(seconds):
    time.sleep(seconds)
    return os.getpid()

def lookup(record):
    return record["answer"]

def die(code):
    os._exit(code)
"""


def children() -> set[int]:
    """The live descendants of this process (from /proc; zombies are not live): the pool's
    template process and the workers forked from it."""
    found: set[int] = set()
    parents = [os.getpid()]
    while parents:
        parent = parents.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                text = (task / "children").read_text()
            except FileNotFoundError:  # the process ended meanwhile
                continue
            new = {int(p) for p in text.split()} - found
            found |= new
            parents.extend(new)
    return {p for p in found if _alive(p)}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A user's module in a directory of its own on sys.path (the workers get sys.path)."""
    name = f"user_fns_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


async def test_calls_run_in_worker_processes_that_are_gone_after_the_block(
    user: ModuleType,
) -> None:
    before = children()
    async with open_worker_pool(user.pid, size=2) as pool:
        pids = {await pool.run(None) for _ in range(6)}
        assert os.getpid() not in pids
        assert pids <= set(pool.processes)
        assert pids <= children()
    assert children() == before
    assert not any(_alive(p) for p in pids)


async def test_a_hung_call_is_killed_at_its_timeout_and_the_pool_goes_on(
    user: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    before = children()
    async with open_worker_pool(user.sleep, size=2, call_timeout=0.5, name="reward r") as pool:

        async def hang() -> None:
            with pytest.raises(WorkerTimeoutError) as caught:
                await pool.run(3600, label="record id 'r3'")
            assert str(caught.value) == (
                "reward r took longer than 0.5 s on record id 'r3'; its worker process was killed"
            )
            documented("a reward call", str(caught.value), 1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hang)
            # the other worker keeps answering while the first one hangs
            for _ in range(3):
                assert await pool.run(0) in pool.processes
        assert len(pool.processes) <= 2
        assert await pool.run(0) in pool.processes
    assert children() == before


async def test_calls_that_hang_make_the_pool_start_spares_around_them(user: ModuleType) -> None:
    async with open_worker_pool(user.sleep, size=8) as pool:
        for _ in range(5):  # quick calls one at a time share the first workers
            await pool.run(0)
        assert len(pool.processes) <= 2
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(pool.run, 3600)
            with trio.fail_after(60):
                while pool.running < 2:  # noqa: ASYNC110 - the pool signals no event for it
                    await trio.sleep(0.01)
                hung = set(pool.processes)
                assert len(hung) == 2
                # both first workers hang: workers start with no call waiting for them, the
                # first two's worth free again plus as many as hung at once (for the next
                # such burst)
                while len(pool.processes) < 6:  # noqa: ASYNC110 - nor for a worker's start
                    await trio.sleep(0.01)
            pid = await pool.run(0)
            assert pid not in hung
            assert len(pool.processes) == 6
            nursery.cancel_scope.cancel()
        for p in hung:  # the hung ones were killed
            await _gone(p)
        assert pid in pool.processes


async def _gone(pid: int) -> None:
    with trio.fail_after(30):
        while _alive(pid):  # noqa: ASYNC110 - a process's end is no trio event
            await trio.sleep(0.02)


async def test_cancelling_a_hung_call_kills_its_process(user: ModuleType) -> None:
    async with open_worker_pool(user.sleep, size=1) as pool:
        first = await pool.run(0)
        with trio.move_on_after(0.3):
            await pool.run(3600)
        await _gone(first)  # after a short grace, in the background
        assert await pool.run(0) != first  # a new worker takes its place


async def test_a_cancelled_call_that_answers_soon_keeps_its_worker(user: ModuleType) -> None:
    async with open_worker_pool(user.sleep, size=1) as pool:
        first = await pool.run(0)
        with trio.move_on_after(0.05) as scope:
            await pool.run(0.3)
        assert scope.cancelled_caught
        assert await pool.run(0) == first


async def test_what_the_function_raises_comes_back_named(user: ModuleType) -> None:
    async with open_worker_pool(user.lookup, size=1, name="reward m:lookup") as pool:
        with pytest.raises(WorkerCallError) as caught:
            await pool.run({"prompt": "x"}, label="record id 'r7'")
        assert caught.value.line == "KeyError: 'answer'"
        assert caught.value.where.endswith(" in lookup")
        assert str(caught.value).startswith("reward m:lookup raised KeyError: 'answer' (user_fns_")
        assert str(caught.value).endswith(" on record id 'r7'")
        assert await pool.run({"answer": 3}) == 3  # the same worker goes on


async def test_a_worker_that_dies_fails_its_call_only(user: ModuleType) -> None:
    async with open_worker_pool(user.die, size=1) as pool:
        with pytest.raises(WorkerDiedError, match="exit status 3"):
            await pool.run(3, label="record id 'r1'")
    async with open_worker_pool(user.pid, size=1) as pool:
        assert await pool.run(None) > 0


async def test_a_function_a_worker_cannot_load_is_refused_early() -> None:
    before = children()

    def local(record: object) -> float:
        return 1.0

    with pytest.raises(WorkerStartError, match="must be importable as module:name"):
        WorkerPool(local)
    # importable here (a module made in memory), not in a new process
    fake = ModuleType("only_in_the_parent")
    exec("def score(x):\n    return 1.0\n", fake.__dict__)
    fake.score.__module__ = "only_in_the_parent"
    sys.modules["only_in_the_parent"] = fake
    try:
        with pytest.raises(WorkerStartError) as caught:
            async with open_worker_pool(fake.score, size=1, name="reward x") as pool:
                await pool.run(1)
        assert "reward x: cannot load only_in_the_parent:score in a worker process" in str(
            caught.value
        )
        assert "No module named 'only_in_the_parent'" in str(caught.value)
    finally:
        del sys.modules["only_in_the_parent"]
    assert children() == before


async def test_a_stuck_call_is_named_in_the_log_while_it_runs(
    user: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "trio_rl.workers")
    twice = trio.Event()

    def named() -> list[str]:
        return [r.getMessage() for r in caplog.records if "record id 'r11'" in r.getMessage()]

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if len(named()) >= 2:
                twice.set()

    counter = Count()
    logging.getLogger("trio_rl.workers").addHandler(counter)
    try:
        async with (
            open_worker_pool(
                user.sleep, size=1, call_timeout=600, name="reward s", report_every=0.1
            ) as pool,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(lambda: pool.run(3600, label="record id 'r11'"))
            with trio.fail_after(60):
                await twice.wait()
            nursery.cancel_scope.cancel()
    finally:
        logging.getLogger("trio_rl.workers").removeHandler(counter)
    first = named()[0]
    assert first.startswith("reward s: still running on record id 'r11' after ")
    assert first.endswith(" s (the limit is 600 s)")
    documented("a reward call", first)


async def test_the_thread_mode_abandons_a_hung_call_and_keeps_its_own_limiter() -> None:
    release = threading.Event()

    def hang(seconds: float) -> int:
        release.wait(seconds)
        return threading.get_ident()

    try:
        async with open_worker_pool(hang, mode="thread", size=2, call_timeout=0.3) as pool:
            with pytest.raises(WorkerTimeoutError, match="thread was abandoned"):
                await pool.run(3600, label="record id 'r3'")
            assert pool.processes == []
            # one token is still held by the abandoned thread; the other serves
            assert await pool.run(0) != threading.get_ident()
            assert trio.to_thread.current_default_thread_limiter().borrowed_tokens == 0
    finally:
        release.set()


def test_no_worker_outlives_a_parent_killed_with_sigkill(tmp_path: Path) -> None:
    (tmp_path / "user_hang.py").write_text(USER_CODE)
    script = textwrap.dedent(
        """
        import sys, trio
        sys.path.insert(0, sys.argv[1])
        import user_hang
        from trio_rl.workers import open_worker_pool

        async def main():
            async with open_worker_pool(user_hang.sleep, size=2) as pool:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pool.run, 3600)
                    nursery.start_soon(pool.run, 3600)
                    while pool.running < 2:
                        await trio.sleep(0.01)
                    print(*pool.processes, flush=True)
                    await trio.sleep_forever()

        trio.run(main)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2
        assert all(_alive(p) for p in workers)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers)
