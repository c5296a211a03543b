"""Where the publication's loop lag comes from: the synchronous stretches of one 166 MiB step.

`bench_publish.py` measures how late a heartbeat wakes up; on a loaded machine that mixes the
publisher's own pauses with waiting for a core. This probe measures what does not depend on the
machine's load: the CPU time (``time.thread_time``) of each stretch during which the event loop
could not run, whatever the wall clock did meanwhile:

- **on the loop thread**: every task step (a trio `Instrument`: ``before_task_step`` to
  ``after_task_step``, with where the task resumed and where it suspended) and every run-loop
  batch (``after_io_wait`` to the next ``before_io_wait``: every step run between two I/O waits,
  plus trio's own bookkeeping);
- **on the other threads** (the publisher's workers), what keeps the GIL from the loop: every
  C call longer than ``--min-ms`` (a profile hook on threads started after it is installed;
  the hook costs time of its own, so the wall figures of this probe are not the benchmark's)
  and every cyclic-GC collection, on whichever thread it ran.

It ships the same batch as `bench_publish.py`'s ``publisher`` variant (``pack_lazily``, a
`FileSender`, a limiter of 4) ``--repeat`` times and prints the largest stretches of each kind.

Run: ``python benchmarks/probe_publish.py`` (``--no-c-calls`` leaves the profile hook out, so
the loop's figures are measured without its cost).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import trio

from bench_publish import _packer, build_sink
from trio_rl.publish import _pacing, open_publisher
from trio_rl.publish._workers import Workers
from trio_rl.transport import FileSender

_TRIO_DIR = str(Path(trio.__file__).parent)


def _where(task: trio.lowlevel.Task) -> str:
    """The innermost coroutine frame of ``task`` outside trio itself, as ``function:line``."""
    coro: Any = task.coro
    frame: FrameType | None = None
    while coro is not None:
        inner = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if inner is not None and not inner.f_code.co_filename.startswith(_TRIO_DIR):
            frame = inner
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    if frame is None:
        return "?"
    return f"{frame.f_code.co_name}:{frame.f_lineno}"


class LoopProbe(trio.abc.Instrument):
    """Task steps and run-loop batches on the loop thread, in thread CPU and wall time."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, str, str]] = []  # (cpu, wall, task, from -> to)
        self.batches: list[tuple[float, float]] = []  # (cpu, wall)
        self._step: tuple[float, float, str] | None = None
        self._batch: tuple[float, float] | None = None

    def arm(self) -> None:
        """Forget a stretch left open by the previous run (removed mid-step)."""
        self._step = self._batch = None

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step = (time.thread_time(), time.perf_counter(), _where(task))

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._step is None:  # the step that installed the probe
            return
        cpu0, wall0, resumed = self._step
        self._step = None
        self.steps.append(
            (
                time.thread_time() - cpu0,
                time.perf_counter() - wall0,
                task.name,
                f"{resumed} -> {_where(task)}",
            )
        )

    def after_io_wait(self, timeout: float) -> None:
        self._batch = (time.thread_time(), time.perf_counter())

    def before_io_wait(self, timeout: float) -> None:
        if self._batch is not None:
            cpu0, wall0 = self._batch
            self.batches.append((time.thread_time() - cpu0, time.perf_counter() - wall0))
            self._batch = None


class CallProbe:
    """C calls longer than ``min_s`` of thread CPU on the threads it is installed on."""

    def __init__(self, min_s: float) -> None:
        self.min_s = min_s
        self.calls: list[tuple[float, str, str]] = []  # (cpu, C function, called from)
        self._local = threading.local()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            self._local.began = time.thread_time()
        elif event in ("c_return", "c_exception"):
            began = getattr(self._local, "began", None)
            if began is not None:
                cpu = time.thread_time() - began
                self._local.began = None
                if cpu >= self.min_s:
                    name = getattr(arg, "__qualname__", None) or repr(arg)
                    where = f"{frame.f_code.co_name}:{frame.f_lineno}"
                    self.calls.append((cpu, name, where))


class YieldProbe:
    """The thread CPU a worker job spends between two hand-offs of the GIL to the loop: from the
    job's start, or a `Pacer` yield, to the next yield or the job's end (an upper bound of how
    long it kept the GIL: a C call that released it in between, a file write or numpy's sort,
    is counted in)."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float, str]] = []  # (cpu, wall, where the span ended)
        self._local = threading.local()

    def _close(self, where: str) -> None:
        began = getattr(self._local, "began", None)
        if began is not None:
            cpu0, wall0 = began
            self.spans.append((time.thread_time() - cpu0, time.perf_counter() - wall0, where))

    def install(self) -> None:
        probe = self
        real_sleep = _pacing.sleep
        real_job = Workers._job

        def paced_sleep(seconds: float) -> None:
            frame: FrameType | None = sys._getframe(2)
            chain = []
            while frame is not None and len(chain) < 3:
                chain.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                frame = frame.f_back
            probe._close("yield in " + " < ".join(chain))
            real_sleep(seconds)
            probe._local.began = (time.thread_time(), time.perf_counter())

        def job(self: Workers, fn: Callable[..., Any], *args: Any) -> Any:
            probe._local.began = (time.thread_time(), time.perf_counter())
            try:
                return real_job(self, fn, *args)
            finally:
                probe._close(f"end of {getattr(fn, '__qualname__', fn)}")
                probe._local.began = None

        _pacing.sleep = paced_sleep  # type: ignore[assignment]
        Workers._job = job  # type: ignore[method-assign]


class GcProbe:
    """Every collection: (start, thread name, generation, thread CPU, wall)."""

    def __init__(self) -> None:
        self.collections: list[tuple[str, int, float, float, float]] = []
        self._local = threading.local()

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._local.began = (time.thread_time(), time.perf_counter())
            return
        began = getattr(self._local, "began", None)
        if began is not None:
            cpu0, wall0 = began
            self.collections.append(
                (
                    wall0,
                    threading.current_thread().name,
                    info["generation"],
                    time.thread_time() - cpu0,
                    time.perf_counter() - wall0,
                )
            )


async def publish_once(
    args: argparse.Namespace, directory: Path, probe: LoopProbe
) -> tuple[float, float]:
    """Publish one step with the probe installed; its (start, end) on the perf counter."""
    sink = build_sink(args.samples, args.tokens)
    gc.collect()  # as bench_publish: the batch's lists start in the oldest generation
    probe.arm()
    trio.lowlevel.add_instrument(probe)
    await trio.lowlevel.checkpoint()  # the probe's first step starts here
    started = time.perf_counter()
    try:
        limiter = trio.CapacityLimiter(4)
        async with (
            FileSender(directory, world_size=args.ranks, fsync=False, limiter=limiter) as sender,
            open_publisher(
                sink, sender, pack=_packer(args.ranks, args.seq_len), limiter=limiter
            ) as pub,
        ):
            assert await pub.publish() is not None
        ended = time.perf_counter()
        await trio.lowlevel.checkpoint()  # ... and its last step ends here
    finally:
        trio.lowlevel.remove_instrument(probe)
    return started, ended


def _top(rows: list[Any], key: Callable[[Any], float], n: int) -> list[Any]:
    return sorted(rows, key=key, reverse=True)[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--min-ms", type=float, default=1.0, help="C calls reported from")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--no-c-calls", action="store_true", help="no profile hook")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="probe_publish_"))
    loop, calls, gcs = LoopProbe(), CallProbe(args.min_ms / 1e3), GcProbe()
    yields = YieldProbe()
    yields.install()
    if not args.no_c_calls:
        threading.setprofile(calls)  # worker threads start inside trio.run, after this
    gc.callbacks.append(gcs)
    windows = []
    try:
        for i in range(args.repeat):
            windows.append(trio.run(publish_once, args, root / f"run{i}", loop))
            shutil.rmtree(root / f"run{i}")
    finally:
        gc.callbacks.remove(gcs)
        threading.setprofile(None)  # type: ignore[arg-type]
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{args.repeat} publications of {args.samples} x ~{args.tokens} tokens "
        f"(wall {', '.join(f'{e - s:.2f}' for s, e in windows)} s); thread CPU ms / wall ms"
    )
    print(f"loop: {len(loop.steps)} task steps, {len(loop.batches)} run-loop batches")
    for cpu, wall, name, where in _top(loop.steps, lambda r: r[0], args.top):
        print(f"  step  {cpu * 1e3:7.2f} / {wall * 1e3:7.2f}  {name}: {where}")
    for cpu, wall in _top(loop.batches, lambda r: r[0], 3):
        print(f"  batch {cpu * 1e3:7.2f} / {wall * 1e3:7.2f}")
    loop_thread = threading.main_thread().name
    during = [c[1:] for c in gcs.collections if any(s <= c[0] <= e for s, e in windows)]
    print(f"collections during the publications: {len(during)}")
    for thread, generation, cpu, wall in _top(during, lambda r: r[2], args.top):
        side = "loop" if thread == loop_thread else "worker"
        print(f"  gen{generation} {cpu * 1e3:7.2f} / {wall * 1e3:7.2f}  on the {side} thread")
    print(f"worker spans between GIL hand-offs: {len(yields.spans)}")
    for cpu, wall, where in _top(yields.spans, lambda r: r[0], args.top):
        print(f"  {cpu * 1e3:7.2f} / {wall * 1e3:7.2f}  {where}")
    # The span that ends with of_parts's first `_paced` yield is numpy's sort, which runs with
    # the GIL released (the loop is free meanwhile): reported apart.
    held = [r for r in yields.spans if "< of_parts:" not in r[2] or "_paced" not in r[2]]
    sort = max((r[0] for r in yields.spans if r not in held), default=0.0)
    top_step = max((r[0] for r in loop.steps), default=0.0)
    top_gc = max((r[2] for r in during), default=0.0)
    cpu, _, where = max(held, default=(0.0, 0.0, "-"))
    print(
        f"summary: largest loop task step {top_step * 1e3:.2f} ms CPU; largest worker span "
        f"holding the GIL {cpu * 1e3:.2f} ms ({where}), {sum(r[0] >= 2e-3 for r in held)} spans "
        f">= 2 ms over {args.repeat} publications; largest collection {top_gc * 1e3:.2f} ms; "
        f"numpy's sort (GIL released) {sort * 1e3:.2f} ms"
    )
    if not args.no_c_calls:
        print(f"worker C calls >= {args.min_ms:g} ms CPU: {len(calls.calls)}")
        for cpu, name, where in _top(calls.calls, lambda r: r[0], args.top):
            print(f"  {cpu * 1e3:7.2f}  {name} from {where}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
