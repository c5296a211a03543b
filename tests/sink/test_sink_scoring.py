"""GRPO scoring, sample layout and zero-advantage pruning (reference semantics)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_rl.samples import Sample, SampleStatus
from trio_rl.sink import (
    TrainingSample,
    TrainSinkError,
    grpo_advantages,
    prune_detached,
    prune_zero_advantages,
    to_training_sample,
)
from trio_rl.sink._scoring import validate_sample
from trio_rl.wire import PayloadSegment

rewards_st = st.lists(
    st.floats(min_value=-100, max_value=100, allow_nan=False), min_size=1, max_size=16
)


@given(rewards_st)
def test_advantages_are_reward_minus_group_mean(rewards: list[float]) -> None:
    advs = grpo_advantages(rewards)
    mean = math.fsum(rewards) / len(rewards)
    if len(set(rewards)) == 1:
        assert advs == [0.0] * len(rewards)  # exactly, not up to rounding of the mean
    else:
        assert advs == [r - mean for r in rewards]
    assert abs(math.fsum(advs)) <= 1e-9 * max(1.0, max(abs(r) for r in rewards)) * len(rewards)


@given(st.floats(min_value=-5, max_value=5, allow_nan=False), st.integers(1, 8))
def test_equal_rewards_give_exactly_zero(r: float, n: int) -> None:
    assert grpo_advantages([r] * n) == [0.0] * n
    assert grpo_advantages([r] * n, normalize_std=True) == [0.0] * n


def test_std_normalisation() -> None:
    advs = grpo_advantages([0.0, 1.0, 0.0, 1.0], normalize_std=True, eps=0.0)
    assert advs == [-1.0, 1.0, -1.0, 1.0]


def _sample(loss_mask: list[bool], payload: list[PayloadSegment] | None = None) -> Sample:
    n = len(loss_mask)
    return Sample(
        index=7,
        group_index=3,
        prompt_tokens=(5, 6),
        completion_tokens=list(range(10, 10 + n)),
        logprobs=[-0.25] * n,
        loss_mask=loss_mask,
        reward=1.0,
        status=SampleStatus.COMPLETED,
        policy_versions=[4, 5],
        env_name="math",
        payload=payload or (),
    )


def test_training_sample_layout() -> None:
    seg = PayloadSegment("routed_experts", "v4/a.bin", 0, 0, 10, "<i4", [2])
    ts = to_training_sample(
        _sample([True, False, True], [seg]),
        0.5,
        temperature=0.7,
        group_id="g",
        version=4,
        arrival=9,
    )
    assert ts.token_ids == [5, 6, 10, 11, 12]
    assert ts.mask == [False, False, True, False, True]
    assert ts.logprobs == [0.0, 0.0, -0.25, -0.25, -0.25]
    assert ts.advantages == [0.0, 0.0, 0.5, 0.0, 0.5]
    assert ts.temperatures == [0.7] * 5
    assert (ts.env_name, ts.group_id, ts.sample_index, ts.policy_version, ts.arrival) == (
        "math",
        "g",
        7,
        4,
        9,
    )
    # the 10-row segment is clipped to the 5-token sequence
    assert ts.payload == [PayloadSegment("routed_experts", "v4/a.bin", 0, 0, 5, "<i4", [2])]


def test_validation_names_the_field() -> None:
    s = _sample([True, True])
    s.logprobs = [-1.0]
    with pytest.raises(TrainSinkError, match="group g, sample 7: logprobs has 1 entries"):
        validate_sample(s, "group g")
    s = _sample([True])
    s.reward = None
    with pytest.raises(TrainSinkError, match="no reward"):
        validate_sample(s, "group g")


def _ts(mask: list[bool], adv: list[float] | None, **kw: list[float] | None) -> TrainingSample:
    n = len(mask)
    return TrainingSample(
        token_ids=list(range(n)),
        mask=mask,
        logprobs=[0.0] * n,
        temperatures=[1.0] * n,
        env_name="e",
        advantages=adv,
        **kw,  # type: ignore[arg-type]
    )


def test_prune_keeps_samples_without_advantages_untouched() -> None:
    s = _ts([True, True], None)
    assert prune_zero_advantages(s)
    assert s.rl_weights is None


def test_prune_unchanged_sample_keeps_rl_weights_none() -> None:
    s = _ts([False, True], [0.0, 0.3])
    assert prune_zero_advantages(s)
    assert s.rl_weights is None


def test_prune_partial_zero_sets_weights_and_keeps() -> None:
    s = _ts([True, True, False], [0.0, 0.5, 0.0])
    assert prune_zero_advantages(s)
    assert s.rl_weights == [0.0, 1.0, 0.0]


def test_prune_all_zero_drops_unless_other_losses_train() -> None:
    assert not prune_zero_advantages(_ts([True, True], [0.0, 0.0]))
    assert prune_zero_advantages(_ts([True, True], [0.0, 0.0], ce_weights=[0.0, 1.0]))
    assert prune_zero_advantages(_ts([True], [0.0], ref_kl_weights=[0.5]))
    assert not prune_zero_advantages(_ts([True], [0.0], ce_weights=[0.0], ref_kl_weights=[0.0]))


def test_prune_replaces_rl_weights_instead_of_editing_them() -> None:
    original = [1.0, 1.0]
    s = _ts([True, True], [0.0, 1.0], rl_weights=original)
    assert prune_zero_advantages(s)
    assert original == [1.0, 1.0]
    assert s.rl_weights == [0.0, 1.0]
    assert s.rl_weights is not original


@given(
    st.lists(
        st.tuples(st.booleans(), st.sampled_from([0.0, 0.5, -1.0]), st.sampled_from([0.0, 1.0])),
        min_size=1,
        max_size=12,
    ),
    st.booleans(),
)
def test_prune_matches_the_reference_definition(
    rows: list[tuple[bool, float, float]], with_rl: bool
) -> None:
    mask = [m for m, _, _ in rows]
    adv = [a for _, a, _ in rows]
    rl = [w for _, _, w in rows] if with_rl else None
    s = _ts(mask, adv, rl_weights=None if rl is None else list(rl))
    keep = prune_zero_advantages(s)
    base = rl if rl is not None else [1.0 if m else 0.0 for m in mask]
    expected_rl = [0.0 if (m and a == 0.0) else w for m, a, w in zip(mask, adv, base, strict=True)]
    changed = expected_rl != base
    if not changed:
        assert keep
        assert s.rl_weights == rl
    else:
        assert s.rl_weights == expected_rl
        assert keep == any(m and w != 0.0 for m, w in zip(mask, expected_rl, strict=True))


def test_prune_detached_splits_kept_and_pruned() -> None:
    a, b, c = _ts([True], [1.0]), _ts([True], [0.0]), _ts([True], None)
    result = prune_detached([a, b, c])
    assert result.kept == [a, c]  # unchanged samples are passed through as they are
    (pb,) = result.pruned
    assert pb.token_ids is b.token_ids
    assert pb.rl_weights == [0.0]
    assert b.rl_weights is None  # the input is never mutated (a snapshot may share it)
    d = _ts([True, True], [0.0, 1.0])
    (kd,) = prune_detached([d]).kept
    assert kd is not d
    assert kd.rl_weights == [0.0, 1.0]
    assert d.rl_weights is None
