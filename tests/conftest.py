"""Shared test configuration: Hypothesis profiles, and the SIGINT the child processes get.

``ci`` (the nox ``tests`` session) runs 500 examples per property and state machine (the
wire codec's properties, which run once per codec backend, 200 each: ``wire_reference``),
``thorough`` many more; a bare ``pytest`` uses the quicker ``dev`` profile.
"""

from __future__ import annotations

import os
import signal

from hypothesis import HealthCheck, settings

_common = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("dev", _common, max_examples=60)
settings.register_profile("ci", _common, max_examples=500, derandomize=True)
settings.register_profile("thorough", _common, max_examples=5000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

THOROUGH = bool(os.environ.get("TRIO_RL_THOROUGH"))


def scaled(n: int) -> int:
    """An example or trial count for an expensive test: ``n`` normally, 10x when thorough."""
    return n * 10 if THOROUGH else n


# A shell starts a background job (``pytest ... &``, nohup, some CI runners) with SIGINT
# ignored, and an ignored signal stays ignored across exec: every ``trio-rl`` the tests start
# would then ignore the SIGINT they send it, and wait for it forever. A handled signal is reset
# to its default on exec, so the children get Python's usual KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
