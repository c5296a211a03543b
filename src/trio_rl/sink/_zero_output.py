"""#3806's zero-output budget: finished groups that gave the trainer nothing, counted in
batch-equivalents, with a warning at each one."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs

from ..samples import Sample

__all__ = ["ZeroOutputBudget"]

logger = logging.getLogger("trio_rl.sink")


@attrs.define(slots=True, eq=False)
class ZeroOutputBudget:
    """How much finalized work has produced no admitted training payload since the last group
    that did (the reference's ``zero_output_units``).

    Each finished group that queues nothing for training (all of it stale, filtered, pruned,
    failed or cancelled; a group voided by the staleness check too) adds *units*: in batch mode
    (``tokens=False``) its survivors (members that would train: none when nothing queued),
    else the members it returned, else the members it owed; in token mode the tokens of the
    same, the owed members costing at least their prompt each (the sink knows no maximum
    length, which the reference uses). Each time the units cross another multiple of
    ``target`` (one batch-equivalent: the batch size in samples or tokens) one warning is
    logged: "no admitted train payload after N finalized units ...", the first ``log_first``
    times (the reference logs every one; an engine failing every request would log one per
    step's worth of groups). A group that queues training samples resets the count.

    The count is a warning only: it never stops anything (a learning run's
    ``[run] converged_after`` is its stop rule).
    """

    target: int
    tokens: bool = False
    units: int = 0
    #: Multiples of ``target`` already crossed (warned about, up to ``log_first``).
    reported: int = 0
    #: Crossings logged after each admitted group; later ones are only counted.
    log_first: int = 3

    def admitted(self) -> None:
        """A group queued training samples: the count starts again."""
        self.units = self.reported = 0

    def finished_empty(self, returned: Sequence[Sample], owed: int, prompt_len: int) -> None:
        """A group finished with nothing admitted: ``returned`` its finished members, ``owed``
        its attempt budget (every member, failed and cancelled ones included)."""
        if self.tokens:
            got = sum(len(s.prompt_tokens) + len(s.completion_tokens) for s in returned)
            units = got or max(1, prompt_len) * owed
        else:
            units = len(returned) or owed
        self.units += units
        windows = self.units // self.target
        if windows > self.reported:
            self.reported = windows
            # The first few crossings are logged, later ones only counted: an engine that fails
            # every request crosses one per step's worth of groups, and its own error says why.
            if windows > self.log_first:
                return
            logger.warning(
                "no admitted train payload after %d finalized units (%s; %d batch-equivalent(s) "
                "of %d): every group finished since the last admitted one gave nothing to "
                "train (stale, filtered, zero-advantage, failed or cancelled)%s",
                self.units,
                "tokens" if self.tokens else "samples",
                windows,
                self.target,
                "; further ones are only counted" if windows == self.log_first else "",
            )
