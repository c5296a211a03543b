"""The learning run's commands, ``trio-rl run`` and ``trio-rl trainer``: the glue between the
configuration, the run directory, the signal watcher, the metrics sinks and
`trio_rl.learn.run_learning`.

Importing this module imports neither torch nor `trio_rl.learn`: each command checks that torch
is installed and then imports them (seconds), before its event loop starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from ._flags import RUN_FLAGS, layers, overrides
from ._jobs import STARTUP, RunLog, Stop, check_out, resume_command, stop_on_signals, trio_run
from .config import ConfigError, LearnRunConfig, check_resume, load, store
from .errors import TrioRLError
from .rundir import RunDirectory


def _load(args: argparse.Namespace) -> tuple[LearnRunConfig, dict[str, str]]:
    """The run's configuration, its run directory chosen (``runs/<time>`` when unset) and
    checked, and a resumed run's stored configuration compared; no torch needed yet."""
    learn_cfg, origin = load(LearnRunConfig, args.configs, layers(LearnRunConfig, args, RUN_FLAGS))
    if learn_cfg.trainer.mode == "inprocess" and learn_cfg.trainer.ranks != 1:
        raise ConfigError(
            origin.get("trainer.ranks", "defaults"),
            "trainer.ranks",
            'the in-process trainer has one rank; set trainer.mode = "torchrun"',
        )
    check_stamped_temperature(learn_cfg, origin)
    args.default_out = learn_cfg.run.out is None
    if learn_cfg.run.out is None:  # runs/<time> under the current directory, kept
        learn_cfg = attrs.evolve(
            learn_cfg, run=attrs.evolve(learn_cfg.run, out=str(_default_run_directory()))
        )
    if learn_cfg.run.out is not None:
        out = Path(learn_cfg.run.out)
        check_out(out)
        if not args.fresh and RunDirectory(out).has_checkpoints():
            check_resume(LearnRunConfig, learn_cfg, out, args.allow_change)
    return learn_cfg, origin


def check_stamped_temperature(cfg: LearnRunConfig, origin: dict[str, str]) -> None:
    """``[sink] scoring_temperature`` and ``scoring_env_temperatures``, when set, are
    ``rollout.temperature``: the trainer scores every token at its stamped temperature, and the
    run samples every token at ``rollout.temperature``. Another value is a `ConfigError` naming
    both keys (exit 2)."""
    sampled = cfg.rollout.temperature
    stamped: float | None = cfg.sink.scoring_temperature
    others = {env: t for env, t in cfg.sink.scoring_env_temperatures.items() if t != sampled}
    for key, value in (
        ("sink.scoring_temperature", None if stamped in (None, sampled) else f"{stamped:g}"),
        ("sink.scoring_env_temperatures", str(others) if others else None),
    ):
        if value is None:
            continue
        where = ", ".join(
            f"{k} at {origin.get(k, 'defaults')}" for k in (key, "rollout.temperature")
        )
        raise ConfigError(
            where,
            key,
            f"{value} conflicts with rollout.temperature = {sampled:g}: the run samples every "
            "token at rollout.temperature and the trainer scores it at the stamped one, so "
            "they must be equal (leave the key unset: it is rollout.temperature)",
        )


def run_command(args: argparse.Namespace) -> int:
    """``trio-rl run``: the learning run, in-process, under the signal watcher."""
    learn_cfg, origin = _load(args)
    if importlib.util.find_spec("torch") is None:
        raise RuntimeError(
            "the learning run needs torch (pip install 'trio-rl[learn]'; on a CPU machine "
            "install torch==2.13.0 first); `trio-rl simulate` runs without it"
        )
    import torch  # seconds to import: before the event loop starts, never inside it

    # the per-step line already shows the stale counter; the sink's warning would repeat it
    logging.getLogger("trio_rl.sink").setLevel(logging.ERROR)
    torch.set_num_threads(1 if learn_cfg.run.deterministic else learn_cfg.run.threads)
    check_run_inputs(learn_cfg, origin)
    config = _Run(learn_cfg, resume=not args.fresh)
    if learn_cfg.run.max_steps is not None:
        shipped = _last_shipped(config.out) if _resuming(config) else 0
        # the run caps its steps itself (from the step it resumes at, its checkpoint's:
        # metrics.jsonl may lag behind it); this only spares a run with nothing to do
        if learn_cfg.run.max_steps - shipped <= 0:
            print(
                f"trio-rl: the run in {config.out} has shipped step {shipped}, its "
                f"run.max_steps ({learn_cfg.run.max_steps}): nothing to do (raise "
                "--max-steps to go on)"
            )
            return 0
    resume = resume_command(args.argv)
    if args.default_out:  # the command again must find this run's directory
        resume = shlex.join([*shlex.split(resume), "--out", str(config.out)])
    return trio_run(_run_learning, config, learn_cfg, resume)


def check_run_inputs(cfg: LearnRunConfig, origin: dict[str, str]) -> None:
    """The model directory, the reward and the data file of a run, checked before anything
    starts: a bad one is a `ConfigError` naming the key and what is wrong (exit 2)."""
    from .learn import check_model_dir
    from .rollout import DataSourceError, RolloutConfigError, import_reward, read_records

    if cfg.model.path is not None:
        check_model_dir(cfg.model.path, origin.get("model.path", "model.path"))
    spec = cfg.reward.function or f"trio_rl.learn.tasks:{cfg.rollout.task}"
    try:
        import_reward(spec)
    except RolloutConfigError as exc:
        raise ConfigError(
            origin.get("reward.function", "defaults"), "reward.function", str(exc)
        ) from None
    if cfg.data.prompts is not None:
        try:
            read_records(cfg.data.prompts)
        except DataSourceError as exc:
            raise ConfigError(
                origin.get("data.prompts", "data.prompts"), "data.prompts", str(exc)
            ) from None


def trainer_command(args: argparse.Namespace) -> int:
    """``trio-rl trainer CONFIG.toml``: the run's trainer job in this process (one rank of a
    torchrun job, or the only one)."""
    STARTUP.release()  # no event loop of ours watches signals: the job is killed as it is
    cfg, origin = load(LearnRunConfig, args.configs, overrides(args, ()))
    if cfg.run.out is None:
        raise ConfigError(
            origin.get("run.out", "defaults"),
            "run.out",
            "the trainer job needs the run directory it shares with the orchestrator (run.out)",
        )
    if importlib.util.find_spec("torch") is None:
        raise RuntimeError("the trainer job needs torch (pip install 'trio-rl[learn]')")
    import torch  # noqa: F401 - seconds to import: before the job starts

    from . import learn
    from .learn import trainer_job

    if cfg.model.path is not None:
        check = learn.check_model_dir
        check(cfg.model.path, origin.get("model.path", "model.path"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.trainer.ranks:
        raise ConfigError(
            origin.get("trainer.ranks", "defaults"),
            "trainer.ranks",
            f"{cfg.trainer.ranks}, but the job has {world} rank(s) (torchrun's --nnodes x "
            "--nproc-per-node)",
        )
    code = trainer_job.run_job(cfg)
    if code == 0 and int(os.environ.get("RANK", "0")) == 0:
        print(_trainer_exit_line(cfg, args.argv), flush=True)
    if "WORLD_SIZE" in os.environ:
        trainer_job.exit_hard(code)
    return code


def eval_command(args: argparse.Namespace) -> int:
    """``trio-rl eval CONFIG.toml [--weights DIR | --model DIR]``: one held-out eval, offline;
    a table on stdout, the record appended to ``--out``, a progress bar on stderr."""
    STARTUP.release()  # no signal watcher: Ctrl-C is a KeyboardInterrupt (exit 130)
    cfg, origin = load(LearnRunConfig, args.configs, overrides(args, ()))
    for flag, path in (("--weights", args.weights), ("--model", args.model)):
        if path is not None and not path.is_dir():
            raise ConfigError(flag, "", f"{path}: not a directory")
    if importlib.util.find_spec("torch") is None:
        raise RuntimeError("trio-rl eval needs torch (pip install 'trio-rl[learn]')")
    import torch

    torch.set_num_threads(cfg.run.threads)
    check_run_inputs(cfg, origin)
    _check_eval_inputs(cfg, origin)
    from .learn import ProgressBar, eval_line, evaluate_offline

    if args.model is not None:
        from .learn import check_model_dir

        check_model_dir(args.model, "--model")
    result = trio.run(
        lambda: evaluate_offline(
            cfg, weights=args.weights, model=args.model, progress=ProgressBar()
        )
    )
    print(eval_table(result))
    line = json.dumps(result.record()) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(line)
    print(f"{eval_line(result)}\nrecord appended to {args.out}")
    return 0


def eval_table(result: Any) -> str:
    """The figures of an `~trio_rl.evals.EvalResult` as a two-column table."""
    rec = result.record()
    rows = [(key, rec[key]) for key in rec if key not in ("step", "status", "k")]
    width = max(len(k) for k, _ in rows)

    def show(value: Any) -> str:
        return "-" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)

    head = f"held-out eval of step {result.step} ({result.status})"
    return "\n".join([head, *(f"  {k:<{width}}  {show(v)}" for k, v in rows)])


def _check_eval_inputs(cfg: LearnRunConfig, origin: dict[str, str]) -> None:
    """``[eval] prompts`` readable and ``[eval] reward`` importable, or a `ConfigError`."""
    from .rollout import DataSourceError, RolloutConfigError, import_reward, read_records

    ev = cfg.eval
    try:
        if ev.prompts is not None:
            read_records(ev.prompts)
        if ev.reward is not None:
            import_reward(ev.reward)
    except (DataSourceError, RolloutConfigError) as exc:
        key = "eval.prompts" if isinstance(exc, DataSourceError) else "eval.reward"
        raise ConfigError(origin.get(key, key), key, str(exc)) from None


@attrs.frozen
class _Run:
    """One invocation of ``trio-rl run``: its configuration (``run.out`` set) and whether it
    continues the run in that directory (no ``--fresh``)."""

    config: LearnRunConfig
    resume: bool

    @property
    def out(self) -> Path:
        return Path(str(self.config.run.out))

    @property
    def trainer_mode(self) -> str:
        return str(self.config.trainer.mode)


def _trainer_exit_line(cfg: LearnRunConfig, argv: list[str]) -> str:
    """Why the trainer job exits: the orchestrator's last step and why it stopped (its
    ``ended.json``), and, when the run is not over, the command that starts the job again."""
    from .learn._verdict import read_ended, resumes

    assert cfg.run.out is not None
    run = RunDirectory(Path(cfg.run.out))
    ended = read_ended(run.root) or {}
    step = ended.get("step", "?")
    stopped = ended.get("stopped")
    again = resume_command(argv)
    if stopped == "signal":
        return (
            f"trainer job: the orchestrator stopped at step {step} (STOP: it was stopped by a "
            f"signal), and every step up to it is trained; start me again with: {again} "
            "(beside the resumed `trio-rl run`)"
        )
    if resumes(ended, cfg.run.max_steps):
        because = "its time_limit" if stopped == "time_limit" else "it shipped its --steps"
        until = "" if cfg.run.max_steps is None else f", up to run.max_steps {cfg.run.max_steps}"
        return (
            f"trainer job: the orchestrator stopped at step {step} (STOP: {because}), and every "
            f"step up to it is trained; start me again with: {again} (beside the next "
            f"`trio-rl run`{until})"
        )
    why = ended.get("message") or {"steps": "it shipped its steps"}.get(str(stopped), stopped)
    return (
        f"trainer job: the orchestrator ended the run at step {step} (STOP"
        + (f": {why}" if why else "")
        + "), and every step up to it is trained; done"
    )


async def _run_learning(config: _Run, file_config: LearnRunConfig, resume: str) -> int:
    """The learning run under the signal watcher: the first SIGINT or SIGTERM ends the step in
    progress (its accounting settles as the orchestrator closes), then the run finishes as
    after its last step (metrics, plot, transports closed)."""
    from . import learn

    stop = Stop()
    run_log = RunLog(Path(config.out), file_config.run.log_level)
    async with trio.open_nursery() as watcher:
        await watcher.start(stop_on_signals, stop)
        await trio.to_thread.run_sync(_store_learning_config, file_config, config.out)
        await trio.to_thread.run_sync(run_log.open)
        try:
            sinks = await trio.to_thread.run_sync(
                lambda: open_metric_sinks(
                    file_config.metrics, config.out, file_config, _resuming(config)
                )
            )
            try:
                result = await learn.run_learning(
                    config.config,
                    resume=config.resume,
                    stop=stop.event,
                    first_step=stop.started,
                    display=_open_display(
                        file_config.metrics.display,
                        total=_steps_to_ship(config),
                        stream=run_log.terminal,
                        log=run_log.console.info,
                    ),
                    sinks=sinks,
                )
            finally:
                if sinks is not None:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(sinks.close)
            _closing_lines(config, file_config, resume)
        finally:
            run_log.close()
        watcher.cancel_scope.cancel()
    if not stop.signals:
        if result.stopped == "no_signal" and not result.metrics:
            # the reason was printed above, once; the status says the run did nothing
            print(
                "trio-rl: error: no step could be trained (every group's rewards were equal); "
                "fix the reward and run the same command again",
                file=sys.stderr,
                flush=True,
            )
            return 1
        return 0
    if not result.started:
        stop.report("while starting (before its first step): nothing to save")
        return stop.status
    out = config.out
    last = result.metrics[-1]["step"] if result.metrics else (result.resumed_at or 1) - 1
    hint = _resume_hint(config, resume)
    if result.checkpoint is not None and config.trainer_mode != "inprocess":
        saved = (
            f"saved {result.checkpoint} and {RunDirectory(out).config} (the {config.trainer_mode} "
            f"trainer job keeps its own state in {RunDirectory(out).trainer}); resume with: "
            f"{hint}"
        )
    elif result.checkpoint is not None:
        saved = (
            f"saved {result.checkpoint}, the trainer's state of step {result.trained_through} "
            f"and {RunDirectory(out).config}; resume with: {hint}"
        )
    else:  # the signal came after the last step: its checkpoint is the run's last
        saved = (
            f"saved {RunDirectory(out).metrics} and the checkpoints in "
            f"{RunDirectory(out).checkpoints}; resume with: {hint}"
        )
    stop.report(f"after step {last}: {saved}")
    return stop.status


def _last_shipped(out: Path) -> int:
    """The last step the run in ``out`` shipped (its ``metrics.jsonl``), 0 for none."""
    from .tools.metrics import read_metrics

    try:
        records = read_metrics(RunDirectory(out).metrics)
    except TrioRLError:  # no file (a new run) or a damaged one: the run itself says so
        return 0
    return max((r["step"] for r in records if "samples" in r or "wall_s" in r), default=0)


def _default_run_directory() -> Path:
    """``runs/<YYYYmmdd-HHMMSS>`` under the current directory (``-2``, ``-3``, ... when a run
    started in the same second)."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _closing_lines(config: _Run, file_config: LearnRunConfig, resume: str) -> None:
    """The last lines of a run: where everything it wrote is, and how to go on."""
    out = Path(config.out)
    print(f"run directory: {out}", flush=True)
    print(f"  metrics: {RunDirectory(out).metrics}", flush=True)
    if file_config.metrics.plot:
        print(f"  plot:    {RunDirectory(out).plot}  (again: trio-rl plot {out})", flush=True)
    print(f"  log:     {RunDirectory(out).run_log}", flush=True)
    print(f"  resume:  {_resume_hint(config, resume)}", flush=True)


def _resume_hint(config: _Run, resume: str) -> str:
    """How the run goes on, whichever the trainer mode: the orchestrator resumes from its
    checkpoint, and the trainer from its saved state (the in-process one; a torchrun job the
    command starts again, which resumes after its saved step). An external trainer job exited
    after the last shipped step: it is started again by hand beside the resumed run."""
    if config.trainer_mode != "external":
        return resume
    stored = RunDirectory(config.out).config
    return (
        f"{resume}  (and start the trainer job again, as before: "
        f"{shlex.join(['trio-rl', 'trainer', str(stored)])}, under torchrun for several ranks)"
    )


def _open_display(
    kind: str, *, total: int | None = None, stream: Any = None, log: Any = None
) -> Any:
    """The console display of `trio_rl.tools.console` for ``metrics.display``: ``table`` (or
    ``auto`` on a terminal with ``rich`` installed) the live table and progress bar, else one
    plain line per step; ``log`` gets every step's plain line either way."""
    from .tools.console import ConsoleDisplay

    out = sys.stdout if stream is None else stream
    if kind == "plain":
        plain = True
    elif kind == "table":
        plain = False
    else:
        plain = not (out.isatty() and importlib.util.find_spec("rich") is not None)
    # the plain lines are printed to the terminal stream itself: the log gets them from `log`
    return ConsoleDisplay(out, plain=plain, total=total, log=log)


def _steps_to_ship(config: _Run) -> int:
    """The steps this invocation ships, as the progress display counts them: ``steps``, or
    fewer up to ``max_steps`` (an estimate from ``metrics.jsonl``; the run caps itself)."""
    run = config.config.run
    if run.max_steps is None:
        return run.steps
    shipped = _last_shipped(config.out) if _resuming(config) else 0
    return max(1, min(run.steps, run.max_steps - shipped))


def _resuming(config: _Run) -> bool:
    """Whether the learning run continues the run in its directory (as `trio_rl.learn` decides:
    checkpoints there, no ``--fresh``; whichever the trainer mode, since a torchrun or external
    trainer job resumes by itself beside the resumed orchestrator)."""
    return bool(config.resume and RunDirectory(config.out).has_checkpoints())


def _wandb_init(metrics: Any, out: Path, file_config: Any) -> dict[str, Any]:
    """``wandb.init`` arguments of ``[metrics]``: project, name, entity, tags and the
    effective configuration (by section)."""
    init: dict[str, Any] = {
        "project": metrics.wandb_project,
        "name": metrics.wandb_name or out.name,
        "dir": str(out),
    }
    if metrics.wandb_entity is not None:
        init["entity"] = metrics.wandb_entity
    if metrics.wandb_tags is not None:
        init["tags"] = [t.strip() for t in metrics.wandb_tags.split(",") if t.strip()]
    if file_config is not None:
        init["config"] = attrs.asdict(file_config)
    return init


def open_metric_sinks(
    metrics: Any, out: Path, file_config: Any = None, resume: bool = False
) -> Any:
    """The optional metrics sinks ``[metrics]`` asks for (TensorBoard, W&B, Prometheus), fed
    the same records as ``metrics.jsonl``; None when none is asked for. A missing extra is a
    one-line error naming the extra to install. ``resume``: the run continues the one in
    ``out``, and so does its W&B run (its id kept in ``out``)."""
    if not (metrics.tensorboard or metrics.wandb_project is not None) and (
        metrics.prometheus_port is None
    ):
        return None
    from .tools import metrics as sinks

    opened: list[Any] = []
    try:
        if metrics.tensorboard:
            opened.append(sinks.TensorBoardSink(RunDirectory(out).tensorboard))
        if metrics.wandb_project is not None:
            opened.append(
                sinks.WandbSink(
                    id_file=out / sinks.WANDB_ID_FILE,
                    resume=resume,
                    **_wandb_init(metrics, out, file_config),
                )
            )
        if metrics.prometheus_port is not None:
            prometheus = sinks.PrometheusSink(metrics.prometheus_port, host=metrics.prometheus_host)
            print(
                f"metrics: Prometheus endpoint on port {prometheus.port} "
                f"(http://{metrics.prometheus_host}:{prometheus.port}/metrics)",
                flush=True,
            )
            opened.append(prometheus)
    except BaseException:
        sinks.FanOut(opened).close()
        raise
    return sinks.FanOut(opened)


def _store_learning_config(file_config: LearnRunConfig, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    store(attrs.evolve(file_config, run=attrs.evolve(file_config.run, out=str(out))), out)
