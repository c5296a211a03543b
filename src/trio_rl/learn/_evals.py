"""The learning run's held-out evals (`trio_rl.evals`), from its ``[eval]`` section: the
held-out prompts, the eval's reward and sampling, the runner, and `open_run_evals`, which
opens a run's evals on its engine and its driver's priority lane."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from ..config import LearnRunConfig
from ..engines import Engine, SamplingParams
from ..evals import BUILTIN_HELD_OUT, EvalJournal, EvalResult, EvalRunner, RunEvals
from ..orchestrator import Orchestrator
from ..rollout import PriorityLane, RecordReward, engine_generate, import_reward, read_records
from ..samples import PolicyVersion, Prompt, Sample
from ._episodes import env_function, episode_runner
from ._policy import Policy, record_prompts
from ._settings import (
    completion_cap,
    orchestrator_config,
    reward_function,
    rollout_config,
    run_directory,
)
from ._steps import Display
from .tasks import task_records

__all__ = ["eval_line", "eval_prompts", "eval_reward", "eval_runner", "open_run_evals"]

logger = logging.getLogger("trio_rl.learn")


def eval_prompts(config: LearnRunConfig, policy: Policy) -> list[Prompt]:
    """The held-out prompts: ``[eval] prompts``, or the built-in task's held-out part (none
    for a run on its own ``[data] prompts``), the first ``num_examples``. Blocking."""
    ev = config.eval
    if ev.prompts is not None:
        records = read_records(ev.prompts)
        where = ev.prompts
    elif config.data.prompts is None:
        task = config.rollout.task
        wanted = ev.num_examples or BUILTIN_HELD_OUT
        records = task_records(task, wanted, config.run.seed, split="held_out")
        where = f"task {task!r} (held out)"
    else:
        return []
    if ev.num_examples is not None:
        records = records[: ev.num_examples]
    return record_prompts(records, policy, where, completion_cap(config, policy))


def eval_reward(
    config: LearnRunConfig, policy: Policy, limiter: trio.CapacityLimiter
) -> RecordReward:
    """The eval's reward: ``[eval] reward``, else the run's own."""
    spec = config.eval.reward or reward_function(config)
    return RecordReward(
        import_reward(spec),
        policy.decode,
        limiter=limiter,
        timeout=config.reward.timeout,
        name=f"eval reward {spec}",
    )


async def _episode_reward(sample: Sample) -> float:
    """An episode's reward: what its environment returned (the runner set it)."""
    return 0.0 if sample.reward is None else sample.reward


def eval_runner(
    config: LearnRunConfig,
    policy: Policy,
    engine: Engine,
    limiter: trio.CapacityLimiter,
    lane: PriorityLane | None = None,
) -> EvalRunner:
    """The runner of ``[eval]`` on ``engine``: its temperature (unset: the rollout's), the
    run's seed, at most the rollout's budget of samples in flight without a ``lane``. With an
    environment (``[eval] env``, else the run's) each sample is an episode it plays, scored by
    what it returns; otherwise a completion scored by the eval's reward."""
    ev = config.eval
    temperature = config.rollout.temperature if ev.temperature is None else ev.temperature
    budget = rollout_config(config).max_groups_in_flight or config.rollout.batch_groups
    max_tokens = completion_cap(config, policy)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    env = config.env.to_config()
    function = ev.env or env_function(env, config.rollout.task, config.model.path)
    episodes = episode_runner(
        env,
        function,
        engine,
        policy,
        params,
        orchestrator_config(config, max_tokens).seq_len,
        limiter,
    )
    return EvalRunner(
        generate=engine_generate(engine, params) if episodes is None else episodes,
        reward=eval_reward(config, policy, limiter) if episodes is None else _episode_reward,
        k=ev.k,
        success_threshold=ev.success_threshold,
        lane=lane,
        max_samples_in_flight=budget * config.rollout.group_size,
        seed=config.run.seed,
        temperature=temperature,
    )


def eval_line(result: EvalResult) -> str:
    """The console line of an eval, printed between the steps' lines."""
    rec = result.record()
    k = result.k
    if result.status == "dropped":
        return f"eval {result.step:>4}  dropped (a stop cut it short; on_resume = drop)"

    def show(key: str) -> str:
        value = rec.get(key)
        return "-" if value is None else f"{value:.3f}"

    figures = "  ".join(f"{key} {show(key)}" for key in (f"avg@{k}", "pass@1", f"pass@{k}"))
    cut = f"  CUT at its deadline after {result.prompts}/{result.prompts_planned} prompts"
    return (
        f"eval {result.step:>4}  held-out {figures}  pass^{k} {show(f'pass^{k}')}  "
        f"({result.prompts} prompts x {k}, policy v{result.policy_version}, "
        f"{result.wall_s:.1f} s)" + (cut if result.status == "cut" else "")
    )


@asynccontextmanager
async def open_run_evals(
    config: LearnRunConfig,
    policy: Policy,
    engine: Engine,
    orch: Orchestrator,
    limiter: trio.CapacityLimiter,
    *,
    served: PolicyVersion,
    sinks: Display | None = None,
) -> AsyncIterator[RunEvals | None]:
    """The run's evals (None: no held-out prompts, or nothing scheduled), sharing the
    training driver's credits through a priority lane for the block; ``served`` is the version
    the engine starts with (an eval a stop cut short is redone or dropped against it)."""
    prompts = await trio.to_thread.run_sync(eval_prompts, config, policy)
    ev = config.eval.to_config()
    if not prompts or (ev.interval == 0 and not ev.before_train):
        yield None
        return
    lane = PriorityLane()

    async def report(result: EvalResult) -> None:
        logger.info("%s", eval_line(result))
        if config.metrics.console:
            print(eval_line(result), flush=True)
        if sinks is not None:  # TensorBoard, W&B, Prometheus: blocking writers
            await trio.to_thread.run_sync(sinks.write, result.sink_record())

    with lane.attach(orch.driver.scheduler, orch.config.group_budget):
        evals = RunEvals(
            config=ev,
            runner=eval_runner(config, policy, engine, limiter, lane),
            prompts=prompts,
            journal=EvalJournal(run_directory(config)),
            report=report,
        )
        await evals.open(served)
        yield evals


async def finish_evals(evals: RunEvals | None, last: PolicyVersion) -> None:
    """At a run's normal end: wait for the evals due up to ``last`` (the last trained version)
    to be recorded, at most ``timeout`` twice and a minute for the last weights to load; the
    last one, if it could not run in that time, is recorded as cut. Never longer."""
    if evals is None:
        return
    with trio.move_on_after(2 * evals.config.timeout + 60):
        await evals.wait_recorded(last)
    await evals.cut(last)
