"""Hypothesis strategies for adversarial schedules.

A schedule is a list of :class:`Step` values drawn in one go (Hypothesis shrinks it by
deleting and simplifying steps). A step names an action and carries the few choices an action
may need: which held engine call (``pick``, taken modulo the number held), the fate to give it
(``kind``, ending ``after`` virtual seconds), and a small number (``value``: a budget, an index
into the time increments). Steps are kept to four primitive choices because drawing is most of
the cost of a cheap example.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from hypothesis import strategies as st

from ._engine import FateKind

__all__ = ["ADVANCE_SECONDS", "DELAYS", "Step", "schedules", "steps"]

#: Delays (virtual seconds) after which a settled call ends; 0 first so shrinking goes towards
#: immediate, step-by-step schedules.
DELAYS: tuple[float, ...] = (0.0, 1.0, 5.0)
#: The virtual time an ``advance`` step lets pass, indexed by ``value - 1``.
ADVANCE_SECONDS: tuple[float, ...] = (1.0, 5.0, 30.0, 100.0)


@attrs.frozen
class Step:
    """One adversary move; see the module docstring for how each field is used."""

    action: str
    pick: int = 0
    kind: FateKind = "stop"
    #: Virtual seconds until a settled call ends (``DELAYS[value - 1]``, capped); also the
    #: budget or time index of other actions.
    value: int = 1

    @property
    def after(self) -> float:
        return DELAYS[min(self.value, len(DELAYS)) - 1]


def steps(actions: Sequence[str], kinds: Sequence[FateKind]) -> st.SearchStrategy[Step]:
    """One :class:`Step` among ``actions`` (the first action is what shrinking goes to)."""
    return st.builds(
        Step,
        action=st.sampled_from(list(actions)),
        pick=st.integers(0, 7),
        kind=st.sampled_from(list(kinds)),
        value=st.integers(1, 4),
    )


def schedules(
    actions: Sequence[str], kinds: Sequence[FateKind], *, max_steps: int = 16
) -> st.SearchStrategy[list[Step]]:
    """A list of up to ``max_steps`` steps."""
    return st.lists(steps(actions, kinds), max_size=max_steps)
