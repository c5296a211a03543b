"""GRPO scoring and zero-advantage pruning: pure functions, safe to run in worker threads."""

from __future__ import annotations

import itertools
import math
import operator
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import attrs

from ..payloads import clip_segments
from ..samples import RESUMED_AT, Group, PolicyVersion, Sample
from ._errors import TrainSinkError
from ._types import TrainingSample

__all__ = [
    "PruneResult",
    "ScoringConfig",
    "GroupScore",
    "grpo_advantages",
    "prune_detached",
    "SequenceLists",
    "build_sequence",
    "build_sequences",
    "prune_zero_advantages",
    "STALENESS_RULES",
    "StalenessRule",
    "sample_version",
    "score_group",
    "to_training_sample",
    "validate_sample",
]


@attrs.frozen
class ScoringConfig:
    """How groups become training samples.

    ``normalize_std`` divides advantages by the group's reward standard deviation (plus ``eps``).
    ``temperature`` is stamped on every token unless ``env_temperatures`` names the sample's env.
    """

    normalize_std: bool = attrs.field(
        default=False,
        metadata={"help": "divide advantages by the group's reward standard deviation (+ eps)"},
    )
    eps: float = attrs.field(
        default=1e-6, metadata={"help": "added to the standard deviation by normalize_std"}
    )
    temperature: float = attrs.field(
        default=1.0, metadata={"help": "sampling temperature stamped on every trained token"}
    )
    env_temperatures: Mapping[str, float] = attrs.field(
        factory=dict,
        metadata={"help": "the stamped temperature per env name, e.g. {math = 0.7}"},
    )

    def temperature_for(self, env_name: str) -> float:
        return self.env_temperatures.get(env_name, self.temperature)


def grpo_advantages(
    rewards: Sequence[float], *, normalize_std: bool = False, eps: float = 1e-6
) -> list[float]:
    """GRPO advantages: ``reward - mean(rewards)``, optionally divided by ``std + eps``.

    Equal rewards give exactly ``0.0`` everywhere (which zero-advantage pruning then removes).
    """
    if not rewards:
        return []
    if rewards.count(rewards[0]) == len(rewards):
        # fsum(n * [r]) / n can differ from r in the last bit; equal rewards carry no signal
        return [0.0] * len(rewards)
    mean = math.fsum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / len(centred))
    return [c / (std + eps) for c in centred]


#: Which version a finished sample is judged stale by (:attr:`SinkConfig.staleness`).
#: ``"group_start"`` (the default, prime-rl's rule): its group's ``policy_version_at_start``,
#: the version the group started with. ``"oldest_token"``: the oldest version behind any of its
#: tokens (never older than the start, so it keeps samples the reference rule drops).
#: The one definition of the allowed values and of the default: `SinkConfig` uses these, and
#: every other config holds a `SinkConfig` (the files' ``[sink]`` section is generated from it).
StalenessRule = Literal["group_start", "oldest_token"]

STALENESS_RULES: tuple[StalenessRule, ...] = typing.get_args(StalenessRule)

DEFAULT_STALENESS: StalenessRule = "group_start"


def sample_version(sample: Sample, start: PolicyVersion, rule: StalenessRule) -> PolicyVersion:
    """The version a sample is judged by under ``rule`` (see :data:`StalenessRule`).

    A sample's *attempt start* is ``start``, or for a member generated for a resumed group the
    version its attempt started with (``metadata[RESUMED_AT]``, see
    :meth:`~trio_rl.rollout.GroupFactory.resume`). ``"group_start"``: the attempt start: each
    member is judged by the version it was generated under, as prime-rl judges each episode.
    ``"oldest_token"``: the oldest version behind any of its tokens; a sample with no recorded
    version (one still to generate) falls back to its attempt start.
    """
    resumed_at = sample.metadata.get(RESUMED_AT)
    attempt = start if resumed_at is None else max(start, resumed_at)
    if rule == "group_start":
        return attempt
    return min(sample.policy_versions) if sample.policy_versions else attempt


def member_is_stale(
    sample: Sample,
    start: PolicyVersion,
    rule: StalenessRule,
    is_stale: Callable[[PolicyVersion], bool],
) -> bool:
    """Whether a member (finished or still to generate) of a group started at ``start`` is
    stale: its :func:`sample_version` under ``rule`` is stale by ``is_stale`` (the sink's
    limit for the batch being collected). The one judgment of a member's staleness: scoring,
    restore and the rollout driver's early expiry (``TrainSink.member_is_stale``) all use it,
    so the driver never cancels work the sink would train."""
    return is_stale(sample_version(sample, start, rule))


def validate_sample(sample: Sample, where: str, *, rewarded: bool = True) -> None:
    """Raise :class:`TrainSinkError` if a finished sample cannot be turned into training data.

    ``rewarded=False`` skips the reward checks (a member reported as it arrives: its group
    reward has not run yet; it is checked again when its group is handed over).
    """
    n = len(sample.completion_tokens)
    for name in ("logprobs", "loss_mask"):
        got = len(getattr(sample, name))
        if got != n:
            raise TrainSinkError(
                f"{where}, sample {sample.index}: {name} has {got} entries but the completion "
                f"has {n} tokens"
            )
    if not rewarded:
        return
    if sample.status.is_finished and sample.reward is None:
        raise TrainSinkError(f"{where}, sample {sample.index}: finished sample has no reward")
    if sample.status.is_finished and not math.isfinite(sample.reward or 0.0):
        raise TrainSinkError(
            f"{where}, sample {sample.index}: reward {sample.reward!r} is not finite"
        )


@attrs.frozen
class SequenceLists:
    """The long per-token lists of one sample's training sequence (prompt then completion).

    Building them is the costly part of scoring; :func:`build_sequences` does it in a worker
    thread so that the sink's counting alone runs on the event loop.
    """

    token_ids: list[int]
    mask: list[bool]
    logprobs: list[float]


def build_sequence(sample: Sample) -> SequenceLists:
    """Token ids, train mask (False on the prompt) and logprobs (0.0 on the prompt)."""
    # C-level list builders (map, repeat) instead of per-token Python loops.
    p = len(sample.prompt_tokens)
    return SequenceLists(
        token_ids=[*sample.prompt_tokens, *sample.completion_tokens],
        mask=[False] * p + list(map(bool, sample.loss_mask)),
        logprobs=[0.0] * p + list(map(float, sample.logprobs)),
    )


def build_sequences(group: Group) -> dict[int, SequenceLists]:
    """:func:`build_sequence` for every finished sample of ``group``, keyed by sample index.

    Pure (reads the samples, which must not change meanwhile); safe in a worker thread. A sample
    whose lists cannot be built is left out, so the sink's validation reports it on the loop.
    """
    built: dict[int, SequenceLists] = {}
    for sample in group.samples:
        if sample.status.is_finished:
            try:
                built[sample.index] = build_sequence(sample)
            except Exception:  # malformed: validated (and reported) by the sink
                continue
    return built


def to_training_sample(
    sample: Sample,
    advantage: float,
    *,
    temperature: float,
    group_id: str,
    version: PolicyVersion,
    arrival: int,
    sequence: SequenceLists | None = None,
) -> TrainingSample:
    """One finished sample as a training sample.

    Token ids are prompt then completion; the prompt is never trained (mask False, logprob 0.0,
    advantage 0.0); completion tokens carry the sample's loss mask and logprobs, and the group
    advantage on every trained token. Payload segments are clipped to the sequence.
    ``sequence`` passes lists already built by :func:`build_sequence`.
    """
    seq = build_sequence(sample) if sequence is None else sequence
    p = len(sample.prompt_tokens)
    loss_mask = sample.loss_mask
    length = len(seq.token_ids)
    payload = sample.payload
    if all(loss_mask):
        completion_advantages = [advantage] * len(loss_mask)
    else:
        completion_advantages = [advantage if m else 0.0 for m in loss_mask]
    return TrainingSample(
        token_ids=seq.token_ids,
        mask=seq.mask,
        logprobs=seq.logprobs,
        temperatures=[temperature] * length,
        env_name=sample.env_name,
        advantages=[0.0] * p + completion_advantages,
        payload=clip_segments(payload, 0, length) if payload else None,
        policy_version=version,
        group_id=group_id,
        sample_index=sample.index,
        arrival=arrival,
    )


@attrs.frozen
class GroupScore:
    """What scoring one complete group yields: its training samples to queue (in arrival order)
    and how many finished members each outcome settles; ``rewards`` are the fresh members'
    rewards (for the metrics window) and ``next_arrival`` the arrival number after it.
    ``zero_length`` counts the filtered members that have no trained token (the publication's
    zero-length warning: they never reach a batch) and ``lengths`` are the completion lengths
    of every finished member scored (stale and filtered ones included)."""

    samples: list[TrainingSample]
    filtered: int
    stale: int
    pruned: int
    rewards: list[float]
    next_arrival: int
    zero_length: int = 0
    lengths: list[int] = attrs.field(factory=list)


def score_group(
    group_id: str,
    finished: Sequence[Sample],
    *,
    start: PolicyVersion,
    aborted: bool,
    is_stale: Callable[[PolicyVersion], bool],
    config: ScoringConfig,
    rule: StalenessRule = DEFAULT_STALENESS,
    prune_before_queue: bool,
    arrival: int,
    sequences: Mapping[int, SequenceLists] | None = None,
) -> GroupScore:
    """Score a complete group's finished members (pure: counts nothing itself).

    A group holding an aborted member is rejected as a whole (all filtered). Stale members
    (judged by ``rule``: the group's ``start`` by default, see :data:`StalenessRule`) are
    dropped; the fresh ones get GRPO advantages over their rewards. A member without a trained
    token is filtered; with ``prune_before_queue`` one whose trained tokens all carry zero
    advantage is pruned (it still takes an arrival number).
    """
    lengths = [len(s.completion_tokens) for s in finished]
    if aborted:
        return GroupScore([], len(finished), 0, 0, [], arrival, lengths=lengths)
    fresh = [s for s in finished if not member_is_stale(s, start, rule, is_stale)]
    stale = len(finished) - len(fresh)
    rewards = [float(s.reward or 0.0) for s in fresh]
    advs = grpo_advantages(rewards, normalize_std=config.normalize_std, eps=config.eps)
    samples: list[TrainingSample] = []
    filtered = pruned = zero_length = 0
    for s, a in zip(fresh, advs, strict=True):
        if not any(s.loss_mask):
            filtered += 1
            zero_length += 1
            continue
        ts = to_training_sample(
            s,
            a,
            temperature=config.temperature_for(s.env_name),
            group_id=group_id,
            version=sample_version(s, start, rule),
            arrival=arrival,
            sequence=None if sequences is None else sequences.get(s.index),
        )
        arrival += 1
        if prune_before_queue and not prune_zero_advantages(ts):
            pruned += 1
            continue
        samples.append(ts)
    return GroupScore(samples, filtered, stale, pruned, rewards, arrival, zero_length, lengths)


def prune_zero_advantages(sample: TrainingSample) -> bool:
    """Zero-advantage pruning of one sample, exactly as the reference defines it.

    Trained tokens (mask True) whose advantage is exactly ``0.0`` and whose rl weight is nonzero
    get rl weight ``0.0``. If nothing changed the sample is kept untouched (``rl_weights`` stays
    None if it was). Otherwise ``rl_weights`` is *replaced* by a new list (never edited in place,
    so a checkpoint snapshot sharing the old list is not torn) and the sample is kept iff some
    trained token still has nonzero rl weight, or some ce or ref-kl weight is nonzero.
    Samples without advantages are kept unchanged. Returns the keep flag.
    """
    adv = sample.advantages
    if adv is None:
        return True
    mask = sample.mask
    if 0.0 not in itertools.compress(adv, mask):
        return True  # no trained token has a zero advantage: nothing changes (C-level scan)
    if sample.rl_weights is None and not any(itertools.compress(adv, mask)):
        # Every trained token has advantage exactly 0.0 (a group of equal rewards): all rl
        # weights become 0.0, which the loop below would reach token by token.
        sample.rl_weights = [0.0] * len(mask)
        return _other_losses_train(sample)
    rl = (
        list(sample.rl_weights)
        if sample.rl_weights is not None
        else [1.0 if m else 0.0 for m in mask]
    )
    changed = False
    for i, m in enumerate(mask):
        if m and adv[i] == 0.0 and rl[i] != 0.0:
            rl[i] = 0.0
            changed = True
    if not changed:
        return True
    sample.rl_weights = rl
    if any(m and rl[i] != 0.0 for i, m in enumerate(mask)):
        return True
    return _other_losses_train(sample)


def _other_losses_train(sample: TrainingSample) -> bool:
    """True if some ce or ref-kl weight is nonzero."""
    if sample.ce_weights is not None and any(w != 0.0 for w in sample.ce_weights):
        return True
    return sample.ref_kl_weights is not None and any(w != 0.0 for w in sample.ref_kl_weights)


@attrs.frozen
class PruneResult:
    """The outcome of post-selection pruning: samples that still train, and those dropped."""

    kept: list[TrainingSample]
    pruned: list[TrainingSample]


def prune_detached(samples: Sequence[TrainingSample]) -> PruneResult:
    """Prune already-detached samples (post-selection mode). Pure apart from ``rl_weights``.

    Safe to run in a worker thread. It never mutates its input: a sample whose weights change is
    replaced by a shallow copy carrying the new ``rl_weights``, so a checkpoint snapshot that still
    shares the original sample is never torn.
    """
    kept: list[TrainingSample] = []
    pruned: list[TrainingSample] = []
    for s in samples:
        c = _clone(s)
        keep = prune_zero_advantages(c)
        out = s if c.rl_weights is s.rl_weights else c
        (kept if keep else pruned).append(out)
    return PruneResult(kept=kept, pruned=pruned)


_FIELDS = tuple(f.name for f in attrs.fields(TrainingSample))
_GET = operator.attrgetter(*_FIELDS)


def _clone(s: TrainingSample) -> TrainingSample:
    """A shallow copy (about 10x faster than ``copy.copy`` on a slotted attrs class)."""
    return TrainingSample(*_GET(s))
