"""Staleness admission and samples that may never arrive: the samples of reward calls running
slow (a reward hanging until its timeout) are not counted as work ahead of new groups, so they
do not hold new work back; what is queued still is."""

from __future__ import annotations

from trio_rl.orchestrator import StalenessAdmission
from trio_rl.samples import Prompt
from trio_rl.sink import SinkConfig, TrainSink


def test_samples_of_slow_reward_calls_do_not_hold_back_new_work() -> None:
    sink = TrainSink(SinkConfig(batch_size=4, max_off_policy_steps=0), step=1)
    # an open group of 4 whose reward calls hang
    sink.open_group("hung", Prompt(key="p", tokens=(1,)), 4, policy_version_at_start=0)
    admission = StalenessAdmission(sink)
    # counted ahead, it fills the batch being collected: a new group would land in step 2,
    # one version too stale at version 0
    assert admission.ahead() == 4
    assert not admission.admits(0, 4)
    slow = 4
    admission.uncounted = lambda: slow
    assert admission.ahead() == 0
    assert admission.admits(0, 4)
    # never fewer than none ahead, whatever the count says
    slow = 9
    assert admission.ahead() == 0
