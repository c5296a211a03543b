"""The orchestrator: rollout -> train sink -> publisher -> transport, checkpointed every step.

It ties the pipeline's layers together (the commands above it, ``trio-rl run`` and
``trio-rl simulate``, add the engine, the transport and the trainer) and owns, in one nursery
hierarchy:

* a fully-async rollout driver (its worker keeps the engine saturated with groups);
* the train sink, fed with finished groups;
* a publisher that finalizes every batch in worker threads and ships it through a
  :class:`~trio_rl.transport.Sender`, writing one checkpoint per shipped step.

The train sink's open-group book is the one record of work in flight (``docs/accounting.md``):
the driver reports every group it submits, each finished member as it arrives, failed attempts
and discards to it (``book=sink.book``). A checkpoint is the sink's state plus the source cursor:
the queue and every group the rollout layer has open (running, buffered or resumed but not
started) with its finished members, so a resume continues those groups under the same id and
regenerates only their missing members. Nothing is merged or patched here.
"""

from ._admission import StalenessAdmission as StalenessAdmission
from ._config import OrchestratorConfig as OrchestratorConfig
from ._config import check_sink_fits_step as check_sink_fits_step
from ._handle import Orchestrator as Orchestrator
from ._handle import RunSummary as RunSummary
from ._open import open_orchestrator as open_orchestrator
