"""The library's own policies, group runner and drivers pass the harness.

Each property runs max_examples adversarial schedules (500 under the ``ci`` profile), checking
SPEC section 5's invariants after every step.
"""

from __future__ import annotations

from trio_rl.rollout import GroupGranularity, SampleBackfill
from trio_rl.testing import (
    RolloutSubject,
    async_driver_property,
    credit_loop_property,
    sync_driver_property,
)

BACKFILL = RolloutSubject(policy=SampleBackfill)
GROUPS = RolloutSubject(policy=GroupGranularity)

test_credit_loop_sample_backfill = credit_loop_property(BACKFILL)
test_credit_loop_group_granularity = credit_loop_property(GROUPS)
test_sync_driver_group_granularity = sync_driver_property(GROUPS)
test_sync_driver_sample_backfill = sync_driver_property(BACKFILL)
test_async_driver_sample_backfill = async_driver_property(BACKFILL)
test_async_driver_group_granularity = async_driver_property(GROUPS)
