"""Turning prompts into groups: indices, group ids, seeds and routing keys."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from .._validation import non_negative_int, optional_int, positive_int
from ..errors import InvalidArgumentError
from ..samples import (
    RESUMED_AT,
    Group,
    OpenGroup,
    PolicyVersion,
    Prompt,
    Sample,
    SampleStatus,
    new_group_id,
)
from ._errors import DataSourceError

__all__ = ["GroupFactory", "RoutingKeys", "SeedRule"]

#: Which sampling seeds a seeded factory gives: ``"group"``, sample ``i`` of every group
#: ``seed + i`` (the reference's rule, miles': the same seed set for every group, so a prompt
#: seen again under the same weights draws the same completions); ``"run"``, sample ``i`` of
#: group ``g`` ``seed + g * group_size + i`` (every sample of the run its own stream).
SeedRule = Literal["group", "run"]

#: Which samples share a routing key: ``"none"`` (no keys), ``"sample"`` (each sample its own
#: uuid, as miles gives them) or ``"group"`` (every sample of a group the same key, so a router
#: sends the whole group to one server, where its shared prompt is in the prefix cache).
RoutingKeys = Literal["none", "sample", "group"]
_ROUTING_KEYS: tuple[RoutingKeys, ...] = ("none", "sample", "group")


def _routing_keys(value: bool | str) -> RoutingKeys:
    # ``True``/``False`` are the older spelling of "sample"/"none"
    if value is True:
        return "sample"
    if value is False:
        return "none"
    for allowed in _ROUTING_KEYS:
        if value == allowed:
            return allowed
    raise DataSourceError(
        f"GroupFactory.routing_keys = {value!r} is not one of {', '.join(_ROUTING_KEYS)}"
    )


@attrs.define(slots=True)
class GroupFactory:
    """Makes a :class:`~trio_rl.samples.Group` of ``group_size`` samples from a prompt.

    Sample indices are consecutive and unique across the run; every group gets the next group
    index and a fresh id (a random prefix per factory, then the group index). With ``seed``
    set, ``seeds`` (:data:`SeedRule`) picks the sampling seeds (:meth:`sample_seed`):
    ``"group"`` (the default, the reference's rule) gives sample ``i`` of every group
    ``seed + i``, the same seed set for every group and every retry; ``"run"`` gives sample
    ``i`` of group ``g`` ``seed + g * group_size + i``, its slot in the run, so every sample
    of a run draws its own stream (the same prompt in another step is another group, and
    draws afresh: what a learning run wants). Either way a group's seeds are consecutive (an
    engine may ask for the whole group in one request, as vLLM's ``n`` seeds choice ``i``
    with ``seed + i``), a retry keeps them, and a run with the same seed and restored
    counters draws the same seeds. ``routing_keys`` (see :data:`RoutingKeys`) gives every
    sample its own uuid routing key (``"sample"``, or ``True``), or every sample of a group the
    group's id as its key (``"group"``: group-sticky routing, which a resumed group keeps, since
    it keeps its id); keys are kept across retries for cache affinity. A recycled prompt carries
    its group's keys in ``prompt.metadata["routing_keys"]`` (see
    :func:`~trio_rl.rollout.recycled_prompt`): sample ``i`` of the group made from it gets key
    ``i`` back, whatever ``routing_keys`` says. The counters are saved by :meth:`state`.
    """

    group_size: int = attrs.field(validator=positive_int)
    seed: int | None = attrs.field(default=None, validator=optional_int)
    routing_keys: RoutingKeys = attrs.field(default="none", converter=_routing_keys)
    seeds: SeedRule = attrs.field(default="group", validator=attrs.validators.in_(("group", "run")))
    next_sample_index: int = attrs.field(default=0, validator=non_negative_int)
    next_group_index: int = attrs.field(default=0, validator=non_negative_int)
    #: Group ids are this prefix and the group index: unique within the factory (the index
    #: only grows) and across factories and resumed runs (a fresh random prefix each), without
    #: a uuid4 per group.
    _id_prefix: str = attrs.field(init=False, factory=new_group_id)

    def sample_seed(self, group_index: int, position: int) -> int | None:
        """The sampling seed of member ``position`` of group ``group_index`` (None unseeded)."""
        if self.seed is None:
            return None
        if self.seeds == "group":
            return self.seed + position
        return self.seed + group_index * self.group_size + position

    def _routing_key(self, prompt: Prompt, group_id: str, position: int) -> str | None:
        kept = prompt.metadata.get("routing_keys")
        if isinstance(kept, list | tuple) and position < len(kept):
            key = kept[position]
            if key is None or isinstance(key, str):
                return key
            raise DataSourceError(
                f"prompt {prompt.key!r}: metadata field 'routing_keys[{position}]' = {key!r} "
                "is not a string or null"
            )
        if self.routing_keys == "group":
            return group_id
        return uuid.uuid4().hex if self.routing_keys == "sample" else None

    def _sample(
        self, prompt: Prompt, group_id: str, group_index: int, position: int, index: int
    ) -> Sample:
        return Sample(
            index=index,
            group_index=group_index,
            prompt_tokens=prompt.tokens,
            seed=self.sample_seed(group_index, position),
            routing_key=self._routing_key(prompt, group_id, position),
            label=prompt.label,
            env_name=prompt.env_name,
            metadata={"prompt_key": prompt.key},
        )

    def make(self, prompt: Prompt, policy_version: PolicyVersion = 0) -> Group:
        """A new group for ``prompt``, opened at ``policy_version``."""
        # The counters are validated fields: one assignment each per group, not per sample.
        group_index, first = self.next_group_index, self.next_sample_index
        size = self.group_size
        group_id = f"{self._id_prefix}-{group_index}"
        samples = [self._sample(prompt, group_id, group_index, i, first + i) for i in range(size)]
        self.next_group_index, self.next_sample_index = group_index + 1, first + size
        return Group(
            group_id=group_id,
            prompt=prompt,
            samples=samples,
            policy_version_at_start=policy_version,
        )

    def resume(self, resumed: OpenGroup, policy_version: PolicyVersion | None = None) -> Group:
        """A group that continues ``resumed``: same id, prompt and start version.

        The arrived members are kept as they are (first, in their order); only the missing ones
        are new ``PENDING`` samples, with fresh indices and the group's index. A group with
        arrived members keeps its index, and its new members take the positions whose seeds no
        arrived member drew: each draws what an original member that never arrived would have,
        and no seed of the group is drawn twice (unseeded, they take the positions after the
        arrived ones). One with none arrived takes the next index and new seeds. With
        ``policy_version`` (the version the resumed attempt starts at), each new member records
        it in ``metadata[RESUMED_AT]``: the ``"group_start"`` staleness rule judges it by that
        version, not by the group's older start. A
        resumed group with nothing missing has no pending sample, so running it generates
        nothing. Arrived members must have finished (not ``PENDING``): an
        `~trio_rl.errors.InvalidArgumentError` (a ``ValueError``) says which one otherwise,
        since the runner would regenerate it.
        """
        for sample in resumed.arrived:
            if sample.status is SampleStatus.PENDING:
                raise InvalidArgumentError(
                    f"resumed group {resumed.group_id}: arrived sample {sample.index} is PENDING"
                )
        if resumed.arrived:
            group_index = resumed.arrived[0].group_index
        else:
            group_index = self.next_group_index
            self.next_group_index += 1
        arrived = list(resumed.arrived)
        first = self.next_sample_index
        positions = self._free_positions(group_index, arrived, resumed.missing)
        missing = [
            self._sample(resumed.prompt, resumed.group_id, group_index, position, first + i)
            for i, position in enumerate(positions)
        ]
        self.next_sample_index = first + resumed.missing
        if policy_version is not None:
            for sample in missing:
                sample.metadata[RESUMED_AT] = policy_version
        return Group(
            group_id=resumed.group_id,
            prompt=resumed.prompt,
            samples=arrived + missing,
            policy_version_at_start=resumed.policy_version_at_start,
        )

    def _free_positions(self, group_index: int, arrived: list[Sample], count: int) -> list[int]:
        # Members arrive in any order, so the arrived ones' seeds say which positions they
        # held; at most len(arrived) positions are taken, so `count` are left.
        start = len(arrived)
        if self.seed is None:
            return list(range(start, start + count))
        taken = {s.seed for s in arrived}
        size = max(self.group_size, start + count)
        return [p for p in range(size) if self.sample_seed(group_index, p) not in taken][:count]

    def state(self) -> dict[str, Any]:
        return {
            "next_sample_index": self.next_sample_index,
            "next_group_index": self.next_group_index,
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        for name in ("next_sample_index", "next_group_index"):
            value = state.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DataSourceError(
                    f"group factory state: field {name!r} must be a non-negative integer, "
                    f"got {value!r}"
                )
        self.next_sample_index = state["next_sample_index"]
        self.next_group_index = state["next_group_index"]
