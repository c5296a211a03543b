"""The library's own policies, group runner and drivers pass the harness.

Each property runs the active profile's max_examples adversarial schedules (500 under ``ci``,
5000 under ``thorough``), each example drawing one of the two library policies
(``SampleBackfill``, ``GroupGranularity``), and checks the invariants of docs/testing.md after every
step. Thorough sessions also draw ten times longer schedules.
"""

from __future__ import annotations

import re

import pytest
import trio

from conftest import scaled
from trio_rl.errors import InvalidArgumentError
from trio_rl.rollout import GenerateFn, GroupRunner, reward_started
from trio_rl.samples import Sample
from trio_rl.testing import (
    RolloutSubject,
    async_driver_property,
    credit_loop_property,
    sync_driver_property,
)

# Defaults: both library policies, GroupRunner, engine_generate with a deadline.
LIBRARY = RolloutSubject(max_steps=scaled(16))

test_credit_loop = credit_loop_property(LIBRARY)
test_sync_driver = sync_driver_property(LIBRARY)
test_async_driver = async_driver_property(LIBRARY)


async def _score_in_a_worker(sample: Sample) -> float:
    # a reward call that gives its sample's credit back as it starts, as one running in a
    # worker process of its own does, then returns later
    reward_started()
    await trio.lowlevel.checkpoint()
    return 1.0


def _runner_with_a_worker_reward(generate: GenerateFn) -> GroupRunner:
    return GroupRunner(generate, sample_reward=_score_in_a_worker)


# Credits returned when a reward call starts, not when it returns: still one per sample,
# every one back, the ledger matching the samples still generating at every decision.
EARLY_CREDITS = RolloutSubject(max_steps=scaled(16), runner=_runner_with_a_worker_reward)
test_credit_loop_with_rewards_in_workers = credit_loop_property(EARLY_CREDITS)
test_async_driver_with_rewards_in_workers = async_driver_property(EARLY_CREDITS)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kinds": ()}, "RolloutSubject.kinds must name at least one fate kind"),
        ({"max_steps": -1}, "RolloutSubject.max_steps must be >= 0, got -1"),
    ],
)
def test_a_bad_subject_argument_is_an_invalid_argument_naming_it(
    kw: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        RolloutSubject(**kw)  # type: ignore[arg-type]
