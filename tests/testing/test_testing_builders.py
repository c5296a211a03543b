"""The shared test builders (tests/builders.py) build what the layers' tests rely on.

``scripted_engine`` is checked where the rollout tests use it
(tests/rollout/test_rollout_group.py: finish reasons, versions, tokens, delay, deadline);
``WatchedCell`` by the ship-gate tests in tests/orchestrator.
"""

from __future__ import annotations

from builders import PROMPT, make_group, make_sample, pending_group
from trio_rl.samples import SampleStatus


def test_make_group_is_finished_and_unique() -> None:
    a = make_group([1.0, 0.0, 0.5], group_id="a", version=2, completion=3, prompt_len=2, env="m")
    b = make_group()
    assert a.group_id == "a"
    assert b.group_id != a.group_id
    assert [s.reward for s in a.samples] == [1.0, 0.0, 0.5]
    assert all(s.status is SampleStatus.COMPLETED for s in a.samples)
    assert all(s.prompt_tokens == (1, 2) and s.env_name == "m" for s in a.samples)
    assert all(len(s.completion_tokens) == len(s.logprobs) == 3 for s in a.samples)
    assert a.policy_version_at_start == 2
    assert all(s.policy_versions == [2] for s in a.samples)
    indices = [s.index for s in a.samples + b.samples]
    assert len(set(indices)) == len(indices)


def test_make_group_statuses_and_sample_reward() -> None:
    group = make_group([1.0, 0.0], statuses=[SampleStatus.COMPLETED, SampleStatus.ABORTED])
    assert [s.status for s in group.samples] == [SampleStatus.COMPLETED, SampleStatus.ABORTED]
    assert make_sample(0, 1.0, status=SampleStatus.PENDING).reward is None


def test_pending_group() -> None:
    group = pending_group(3, seed=42, routing_keys=True)
    assert group.prompt is PROMPT
    assert [s.status for s in group.samples] == [SampleStatus.PENDING] * 3
    assert [s.seed for s in group.samples] == [42, 43, 44]
    assert all(s.routing_key for s in group.samples)
