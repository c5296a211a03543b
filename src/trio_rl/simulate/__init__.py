"""``trio-rl simulate``: the pipeline without a model, beside `trio_rl.learn` (the learning run).

A simulated engine with straggler latencies (or an OpenAI-compatible server), a built-in prompt
set and a verifiable reward feed the full rollout -> sink -> publisher -> transport path; the
transport is the one ``[transport] kind`` names in `trio_rl.transport`'s registry, and
in-process trainer ranks read every batch back, turn it into torch tensors when torch is
installed, and advance the policy version. Every step is checkpointed: the same ``--out`` again
resumes where it stopped.

- `simulate_command`: the command (configuration, run directory, the job under the signal
  watcher);
- `orchestrator_config`: the `~trio_rl.orchestrator.OrchestratorConfig` of a configuration;
- `trio_rl.simulate._ranks`: the trainer ranks.
"""

from __future__ import annotations

from ._job import orchestrator_config as orchestrator_config
from ._job import run_simulation as run_simulation
from ._job import simulate_command as simulate_command
