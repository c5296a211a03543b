"""Validation of a decoded checkpoint: every field's type and range, and the cross-field rules.

Whatever passes can be restored into a :class:`TrainSink` and resumed; anything else raises
:class:`CodecError` naming the field path (``sink.open_groups[3].members[1].logprobs``), which
the reader turns into a :class:`CheckpointError` naming the file too. Counts are bounded by the
bytes left in the file before anything is allocated for them.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..samples import OpenGroup
from ._codec import (
    CodecError,
    decode_prompt,
    decode_sample,
    want_int,
    want_list,
    want_map,
    want_number,
    want_str,
)
from ._queue import SinkCounters, SinkWindow
from ._sink_state import SinkState, state_problem

__all__ = [
    "BoundProblem",
    "Link",
    "Meta",
    "RunBounds",
    "check_state",
    "decode_link",
    "decode_meta",
    "decode_open_group",
    "run_bound_problem",
]

_COUNTERS = tuple(f.name for f in attrs.fields(SinkCounters))
_WINDOW = tuple(f.name for f in attrs.fields(SinkWindow))
#: The bound of every number a run counts up (steps, arrivals, counters, a chain's position):
#: far beyond any real run, and far enough below the int64 a file holds that a resumed run
#: counting on from it never writes a value the reader refuses.
GROWS = 2**62
#: The window's value lists and type counts (a checkpoint written before them has none).
_WINDOW_VALUES = ("rewards", "completion_lengths", "failure_types")


@attrs.frozen
class Meta:
    """The header record, validated."""

    step: int
    progress: dict[Any, Any]
    cursor: Any
    sink_step: int
    next_arrival: int
    counters: SinkCounters
    window: SinkWindow
    n_queued: int
    n_open: int


def _fields(obj: object, what: str, names: tuple[str, ...]) -> dict[Any, Any]:
    m = want_map(obj, what)
    for name in names:
        if name not in m:
            raise CodecError(f"{what}.{name}", "missing")
    unknown = sorted(str(k) for k in m if k not in names)
    if unknown:
        raise CodecError(what, f"unknown fields {unknown}")
    return m


def _counters(obj: object) -> SinkCounters:
    m = _fields(obj, "sink.counters", _COUNTERS)
    return SinkCounters(**{k: want_int(m[k], f"sink.counters.{k}", 0, GROWS) for k in _COUNTERS})


def _window(obj: object) -> SinkWindow:
    m = dict(want_map(obj, "sink.window"))
    empty = SinkWindow()
    for name in ("zero_length", *_WINDOW_VALUES):
        m.setdefault(name, getattr(empty, name))
    m = _fields(m, "sink.window", _WINDOW)
    scalars = [k for k in _WINDOW if k not in ("reward_sum", *_WINDOW_VALUES)]
    values: dict[str, Any] = {k: want_int(m[k], f"sink.window.{k}", 0, GROWS) for k in scalars}
    values["reward_sum"] = want_number(m["reward_sum"], "sink.window.reward_sum")
    what = "sink.window.rewards"
    values["rewards"] = [
        want_number(r, f"{what}[{i}]") for i, r in enumerate(want_list(m["rewards"], what))
    ]
    what = "sink.window.completion_lengths"
    values["completion_lengths"] = [
        want_int(n, f"{what}[{i}]") for i, n in enumerate(want_list(m["completion_lengths"], what))
    ]
    what = "sink.window.failure_types"
    values["failure_types"] = {
        want_str(k, what): want_int(n, f"{what}[{i}]", 0, GROWS)
        for i, (k, n) in enumerate(want_map(m["failure_types"], what).items())
    }
    return SinkWindow(**values)


def decode_meta(obj: object, left: int) -> Meta:
    """The header record; ``left`` is how many body bytes follow it (each record takes one)."""
    m = want_map(obj, "meta")
    for name in ("step", "sink", "n_queued", "n_open"):
        if name not in m:
            raise CodecError(name, "missing from the header record")
    progress = m.get("progress")
    sink = want_map(m["sink"], "sink")
    for name in ("step", "next_arrival", "counters", "window"):
        if name not in sink:
            raise CodecError(f"sink.{name}", "missing")
    n_queued = want_int(m["n_queued"], "n_queued", 0, left)
    return Meta(
        step=want_int(m["step"], "step", 0, GROWS),
        progress={} if progress is None else want_map(progress, "progress"),
        cursor=m.get("cursor"),
        sink_step=want_int(sink["step"], "sink.step", 1, GROWS),
        next_arrival=want_int(sink["next_arrival"], "sink.next_arrival", 0, GROWS),
        counters=_counters(sink["counters"]),
        window=_window(sink["window"]),
        n_queued=n_queued,
        n_open=want_int(m["n_open"], "n_open", 0, left - n_queued),
    )


def decode_open_group(obj: object, what: str) -> OpenGroup:
    """``[group_id, prompt, group_size, start version, [members]]``."""
    gid, prompt, size, start, members = want_list(obj, what, 5)
    group_size = want_int(size, f"{what}.group_size", 1)
    members = want_list(members, f"{what}.members")
    if len(members) > group_size:
        # an open group is saved before it fills: more members than its size is damage
        raise CodecError(
            f"{what}.members", f"{len(members)} members exceed group_size {group_size}"
        )
    return OpenGroup(
        group_id=want_str(gid, f"{what}.group_id"),
        prompt=decode_prompt(prompt, f"{what}.prompt"),
        group_size=group_size,
        policy_version_at_start=want_int(start, f"{what}.policy_version_at_start"),
        arrived=[decode_sample(m, f"{what}.members[{j}]") for j, m in enumerate(members)],
    )


def check_state(state: SinkState) -> None:
    """The sink's cross-field invariants (:func:`state_problem`), as a :class:`CodecError`."""
    problem = state_problem(state)
    if problem is not None:
        raise CodecError(f"sink.{problem[0]}", problem[1])


@attrs.frozen
class Link:
    """Where a file sits in an incremental chain: ``chain`` (an id shared by a base and the
    deltas written after it), ``seq`` (0 for the base, n for the n-th delta after it) and, for a
    delta, the ``parent`` step it was written after (None: a full checkpoint)."""

    chain: int | None
    seq: int
    parent: int | None
    removed: tuple[int, ...] = ()
    closed: tuple[str, ...] = ()


def decode_link(obj: object, *, delta: bool, step: int) -> Link:
    """The chain fields of a header record: optional in a full checkpoint (one written by an
    incremental manager has them), required in a delta."""
    m = want_map(obj, "meta")
    if not delta:
        if "chain" not in m:
            return Link(chain=None, seq=0, parent=None)
        return Link(
            chain=want_int(m["chain"], "chain"),
            seq=want_int(m.get("seq"), "seq", 0, GROWS),
            parent=None,
        )
    for name in ("kind", "chain", "seq", "parent", "removed", "closed"):
        if name not in m:
            raise CodecError(name, "missing from the header record")
    if m["kind"] != "delta":
        raise CodecError("kind", f"{m['kind']!r} in a delta checkpoint (expected 'delta')")
    removed = want_list(m["removed"], "removed")
    closed = want_list(m["closed"], "closed")
    return Link(
        chain=want_int(m["chain"], "chain"),
        seq=want_int(m["seq"], "seq", 1, GROWS),
        parent=want_int(m["parent"], "parent", 0, step - 1),
        removed=tuple(want_int(a, f"removed[{i}]", 0, GROWS) for i, a in enumerate(removed)),
        closed=tuple(want_str(g, f"closed[{i}]") for i, g in enumerate(closed)),
    )


@attrs.frozen(kw_only=True)
class RunBounds:
    """What the run restoring a checkpoint could have produced: a checkpoint holding more is
    from another run, hand-edited or corrupt (see :func:`run_bound_problem`). None: unknown,
    not checked."""

    #: The configured group size: every open group's must equal it (else: a configuration
    #: change, refused like a changed key of the stored configuration).
    group_size: int
    #: Samples the run's group factory has made (``next_sample_index`` of its saved state):
    #: every sample index is below it, and no more samples are held.
    samples_made: int | None = None
    #: Groups the factory has made (``next_group_index``): no more groups are open.
    groups_made: int | None = None
    #: The completion cap of the run's generate function: no member generated more.
    max_completion_tokens: int | None = None
    #: Payload files are one per engine call (:meth:`PayloadStore.write_request`): a member
    #: names at most one per call it made, a queued sample at most one per token.
    payload_files_per_call: bool = False


#: ``(field path, value in the checkpoint, the run's bound, why)``.
BoundProblem = tuple[str, object, object, str]


def run_bound_problem(state: SinkState, bounds: RunBounds) -> BoundProblem | None:
    """The first count of ``state`` beyond what a run with ``bounds`` could have produced.

    O(records), no allocation per token: it runs before anything is restored or started, so a
    checkpoint that claims a million members is refused before one sample is made for it."""
    size, made = bounds.group_size, bounds.samples_made
    n_open = len(state.open_groups)
    if bounds.groups_made is not None and n_open > bounds.groups_made:
        return (
            "sink.open_groups",
            f"{n_open} open groups",
            f"{bounds.groups_made} groups made",
            "more groups open than the run's group factory made (cursor.factory)",
        )
    held = len(state.queued)
    for i, og in enumerate(state.open_groups):
        where = f"sink.open_groups[{i}]"
        if og.group_size != size:
            return (
                f"{where}.group_size",
                og.group_size,
                f"{size} configured",
                "a configuration change (the group size may not change on resume); resume "
                "with the configuration that wrote the checkpoint, or start over",
            )
        for j, m in enumerate(og.arrived):
            if made is not None and m.index >= made:
                return (
                    f"{where}.members[{j}].index",
                    m.index,
                    f"{made} samples made",
                    "a sample the run's group factory never made (cursor.factory)",
                )
            cap = bounds.max_completion_tokens
            if cap is not None and len(m.completion_tokens) > cap:
                return (
                    f"{where}.members[{j}].completion_tokens",
                    f"{len(m.completion_tokens)} tokens",
                    f"{cap} configured",
                    "more tokens than the run's completion cap generates",
                )
            if bounds.payload_files_per_call and m.payload:
                calls = max(1, len(m.policy_versions))
                files = len({seg.file for seg in m.payload})
                if files > calls:
                    return (
                        f"{where}.members[{j}].payload",
                        f"{files} payload files",
                        f"{calls} engine calls",
                        "more payload files than engine calls (one file per call)",
                    )
        held += len(og.arrived)
    for i, ts in enumerate(state.queued):
        if made is not None and ts.sample_index >= made:
            return (
                f"sink.queued[{i}].sample_index",
                ts.sample_index,
                f"{made} samples made",
                "a sample the run's group factory never made (cursor.factory)",
            )
        if bounds.payload_files_per_call and ts.payload:
            files = len({seg.file for seg in ts.payload})
            if files > len(ts.token_ids):
                return (
                    f"sink.queued[{i}].payload",
                    f"{files} payload files",
                    f"{len(ts.token_ids)} tokens",
                    "more payload files than tokens (one file per engine call)",
                )
    if made is not None and held > made:
        return (
            "sink",
            f"{held} samples held (queued and open-group members)",
            f"{made} samples made",
            "more samples than the run's group factory made (cursor.factory)",
        )
    return None
