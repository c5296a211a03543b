"""The worked example in docs/testing.md runs as written, and catches what it should."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings

from trio_rl.rollout import CreditView
from trio_rl.testing import Invariant, InvariantViolationError, RolloutSubject, credit_loop_property

DOC = Path(__file__).parents[2] / "docs" / "testing.md"


def _worked_example() -> dict[str, Any]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("### Worked example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None, "docs/testing.md lost its worked example"
    namespace: dict[str, Any] = {"__name__": "docs_testing_example"}
    exec(compile(code.group(1), str(DOC), "exec"), namespace)
    return namespace


EXAMPLE = _worked_example()

# The example's own test function, collected and run by pytest like the user's would be.
test_docs_worked_example = EXAMPLE["test_capped_backfill_conserves_credits"]


def test_docs_example_rule_is_enforced() -> None:
    """Had the example given a wrong rule, the harness would say so (ADMISSION_FOLLOWS_RULE)."""

    def wrong_rule(view: CreditView) -> bool:
        return bool(EXAMPLE["capped_rule"](view)) and view.pending_groups < 2

    subject = RolloutSubject(policy=EXAMPLE["CappedBackfill"], rule=wrong_rule)
    prop = credit_loop_property(
        subject,
        settings_=settings(
            max_examples=300,
            database=None,
            derandomize=True,
            phases=[Phase.generate, Phase.shrink],
        ),
    )
    with pytest.raises(InvariantViolationError) as info:
        prop()
    assert info.value.invariant is Invariant.ADMISSION_FOLLOWS_RULE
