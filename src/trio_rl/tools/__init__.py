"""Operations tools: ``trio-rl inspect``, ``trio-rl plot``, the live console display and the
metrics sinks (JSONL, TensorBoard, Weights & Biases, Prometheus), all fed the same records.

Imports no optional dependency at import time: each adapter imports its package when built
and raises :class:`MissingExtraError` naming the extra when it is absent.
"""

from ._errors import InspectError as InspectError
from ._errors import MetricsFileError as MetricsFileError
from ._errors import MissingExtraError as MissingExtraError
from ._errors import ToolsError as ToolsError
from .console import ConsoleDisplay as ConsoleDisplay
from .metrics import ALL_FIELDS as ALL_FIELDS
from .metrics import EVAL_FIELDS as EVAL_FIELDS
from .metrics import FIELDS as FIELDS
from .metrics import TRAINER_FIELDS as TRAINER_FIELDS
from .metrics import WANDB_ID_FILE as WANDB_ID_FILE
from .metrics import FanOut as FanOut
from .metrics import JsonlSink as JsonlSink
from .metrics import MetricsSink as MetricsSink
from .metrics import PrometheusSink as PrometheusSink
from .metrics import TensorBoardSink as TensorBoardSink
from .metrics import WandbSink as WandbSink
from .metrics import numeric_fields as numeric_fields
from .metrics import open_sinks as open_sinks
from .metrics import read_metrics as read_metrics
from .metrics import step_record as step_record
