"""User code in workers of its own: a pool of killable worker processes (or, for code that
cannot be pickled or is known to be fast, threads under the pool's own limiter)."""

from ..errors import WorkerCallError as WorkerCallError
from ..errors import WorkerDiedError as WorkerDiedError
from ..errors import WorkerError as WorkerError
from ..errors import WorkerStartError as WorkerStartError
from ..errors import WorkerTimeoutError as WorkerTimeoutError
from ._pool import DEFAULT_WORKERS as DEFAULT_WORKERS
from ._pool import WORKER_MODES as WORKER_MODES
from ._pool import WorkerMode as WorkerMode
from ._pool import WorkerPool as WorkerPool
from ._pool import open_worker_pool as open_worker_pool
