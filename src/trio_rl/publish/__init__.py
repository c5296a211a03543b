"""The publication layer: packing, and the publisher that finalizes batches off the event loop.

Every CPU-heavy step of shipping a batch (pruning after selection, packing, metrics, encoding,
file and checkpoint writes, memory release) runs in worker threads through one shared
`trio.CapacityLimiter`; the event loop only detaches, snapshots and settles.
"""

from ._delivery import Checkpointer as Checkpointer
from ._delivery import SinkCheckpointer as SinkCheckpointer
from ._distribution import Distribution as Distribution
from ._encoding import Encoder as Encoder
from ._errors import MonitorTimeoutError as MonitorTimeoutError
from ._errors import PackingError as PackingError
from ._errors import PublishError as PublishError
from ._errors import ReleaseTimeoutError as ReleaseTimeoutError
from ._metrics import Annotation as Annotation
from ._metrics import AttemptStats as AttemptStats
from ._metrics import CohortStats as CohortStats
from ._metrics import ProgressTotals as ProgressTotals
from ._metrics import SelectionStats as SelectionStats
from ._metrics import ShipRecord as ShipRecord
from ._metrics import ShipTimings as ShipTimings
from ._metrics import ShipWarning as ShipWarning
from ._metrics import ThreadStats as ThreadStats
from ._metrics import WarningKind as WarningKind
from ._metrics import cohort_stats as cohort_stats
from ._metrics import step_record as step_record
from ._packing import PackedRank as PackedRank
from ._packing import pack_lazily as pack_lazily
from ._packing import pack_samples as pack_samples
from ._publisher import BatchSource as BatchSource
from ._publisher import Monitor as Monitor
from ._publisher import Packer as Packer
from ._publisher import Publisher as Publisher
from ._publisher import Shipment as Shipment
from ._publisher import open_publisher as open_publisher
from ._release import DeferredRelease as DeferredRelease
from ._release import malloc_trim as malloc_trim
from ._release import release_containers as release_containers
