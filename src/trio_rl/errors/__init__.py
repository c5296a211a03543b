"""Every exception trio-rl raises, in one tree under :class:`TrioRLError`.

``except trio_rl.TrioRLError`` catches anything the library raised on purpose; each layer has
one base below it, so ``except RolloutError`` catches everything the rollout layer raises.
Classes that also derive from a builtin (``ValueError``, ``OSError``, ``TimeoutError``,
``AssertionError``) keep that base, so ``except ValueError`` around a decode still works::

    TrioRLError
    ├── InvalidArgumentError (ValueError)
    ├── WireFormatError (ValueError)
    ├── WireEncodeError (ValueError)
    ├── PolicyVersionError (ValueError)
    ├── EngineError
    │   ├── EngineConfigError (InvalidArgumentError)
    │   ├── EngineTransportError
    │   ├── EngineRequestError
    │   │   └── EngineAuthError
    │   ├── EngineResponseError
    │   ├── EngineTimeoutError
    │   ├── SimulatedEngineError
    │   └── ScriptedEngineError
    ├── EnvError
    │   ├── EnvConfigError (ValueError)
    │   ├── EpisodeStoppedError
    │   ├── ToolCallSyntaxError (ValueError)
    │   └── TemplateMismatchError
    ├── RolloutError
    │   ├── RolloutConfigError (InvalidArgumentError)
    │   ├── CreditError
    │   ├── DataSourceError
    │   ├── SourceExhaustedError
    │   ├── GroupFailedError
    │   ├── FailureBudgetExceededError
    │   │   └── RewardFailuresError
    │   └── DriverFailedError
    ├── WorkerError
    │   ├── WorkerStartError
    │   ├── WorkerCallError
    │   ├── WorkerTimeoutError
    │   └── WorkerDiedError
    ├── EvalError
    │   └── EvalConfigError (ValueError)
    ├── PayloadError (OSError)
    │   └── PayloadFileMissingError (FileNotFoundError)
    ├── TrainError
    │   ├── TrainSinkError (ValueError)
    │   ├── CodecError (ValueError)
    │   └── CheckpointError
    │       └── CheckpointCompactionError
    ├── PublishError
    │   ├── PackingError (ValueError)
    │   ├── ReleaseTimeoutError
    │   └── MonitorTimeoutError
    ├── TransportError
    │   ├── TransportTimeoutError (TimeoutError)
    │   ├── TransportIOError
    │   └── EndOfStreamError
    ├── TensorConversionError (ValueError)
    ├── ConfigError (ValueError)
    │   └── ConfigChangedError
    ├── ToolsError
    │   ├── InspectError (ValueError)
    │   ├── MetricsFileError (ValueError)
    │   └── MissingExtraError (ImportError)
    └── InvariantViolationError (AssertionError)

Naming rule: every class ends in ``Error``; the words before it name what failed, prefixed by
the layer where the layer is not obvious from them. The names from before this rule were
removed in 0.1.0 (docs/errors.md lists them with the names to catch instead).

Using a closed resource (an engine, publisher, sender or receiver outside its ``async with``)
raises ``trio.ClosedResourceError``, as trio's own channels and streams do; trio-rl has no
"closed" exception of its own. Cancellation is trio's ``Cancelled``, never wrapped.

This package imports nothing else of trio-rl, not even for annotations, so every layer can raise
its classes. The two classes that carry a value of a higher floor are defined on that floor,
under the same root: :class:`~trio_rl.rollout.GroupFailedError` (it holds the failed
:class:`~trio_rl.samples.Group`) and :class:`~trio_rl.testing.InvariantViolationError` (it
names an :class:`~trio_rl.testing.Invariant`).
Private control-flow exceptions (such as the wire decoder's fast-path rejection) derive from
:class:`TrioRLError` too but never escape the library.
"""

from __future__ import annotations

from ._groups import collapse_single as collapse_single

__all__ = [
    "CheckpointCompactionError",
    "CheckpointError",
    "CodecError",
    "ConfigChangedError",
    "ConfigError",
    "CreditError",
    "DataSourceError",
    "DriverFailedError",
    "EndOfStreamError",
    "EngineAuthError",
    "EngineConfigError",
    "EngineError",
    "EngineRequestError",
    "EngineResponseError",
    "EngineTimeoutError",
    "EngineTransportError",
    "EvalConfigError",
    "EvalError",
    "EnvConfigError",
    "EnvError",
    "EpisodeStoppedError",
    "FailureBudgetExceededError",
    "InspectError",
    "InvalidArgumentError",
    "MetricsFileError",
    "MissingExtraError",
    "MonitorTimeoutError",
    "PackingError",
    "PayloadError",
    "PayloadFileMissingError",
    "PolicyVersionError",
    "PublishError",
    "ReleaseTimeoutError",
    "RewardFailuresError",
    "RolloutConfigError",
    "RolloutError",
    "ScriptedEngineError",
    "SimulatedEngineError",
    "SourceExhaustedError",
    "TemplateMismatchError",
    "TensorConversionError",
    "ToolCallSyntaxError",
    "ToolsError",
    "TrainError",
    "TrainSinkError",
    "TransportError",
    "TransportIOError",
    "TransportTimeoutError",
    "TrioRLError",
    "WireEncodeError",
    "WireFormatError",
    "WorkerCallError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerStartError",
    "WorkerTimeoutError",
]


class TrioRLError(Exception):
    """Base class of every exception trio-rl defines."""


class InvalidArgumentError(TrioRLError, ValueError):
    """An argument or a configuration field out of its allowed range or set: the message names
    the field (``OrchestratorConfig.batch_groups must be >= 1, got 0``). Raised by the shared
    checks every config class uses, so ``except ValueError`` keeps working."""


# Wire format ---------------------------------------------------------------------------------


class WireFormatError(TrioRLError, ValueError):
    """A payload that is not a valid array of micro-batches.

    ``offset`` is the byte offset of the offending value (for truncated data, of the value that
    the data ends inside), ``field`` the micro-batch field it belongs to (a path such as
    ``"routed_experts.shape"`` or ``"payload[2].rows"``; ``None`` outside any micro-batch),
    ``micro_batch`` the index of the micro-batch, and ``source`` what the payload came from (a
    file name or ``"step S rank R"``), when the caller said.
    """

    def __init__(
        self,
        reason: str,
        *,
        offset: int,
        field: str | None = None,
        micro_batch: int | None = None,
        source: str | None = None,
    ) -> None:
        self.reason = reason
        self.offset = offset
        self.field = field
        self.micro_batch = micro_batch
        self.source = source
        where = [f"byte offset {offset}"]
        if micro_batch is not None:
            where.append(f"micro-batch {micro_batch}")
        if field is not None:
            where.append(f"field {field!r}")
        prefix = f"{source}: " if source is not None else ""
        super().__init__(f"{prefix}malformed micro-batch payload at {', '.join(where)}: {reason}")


class WireEncodeError(TrioRLError, ValueError):
    """A micro-batch holds a value the wire format cannot carry (e.g. a numpy scalar, a float
    in an int list that the encoder cannot pack, an int beyond 64 bits).

    ``micro_batch`` is the index of the offending micro-batch and ``field`` its field name.
    """

    def __init__(self, reason: str, *, micro_batch: int, field: str) -> None:
        self.reason = reason
        self.micro_batch = micro_batch
        self.field = field
        super().__init__(f"cannot encode micro-batch {micro_batch}, field {field!r}: {reason}")


# Policy version ------------------------------------------------------------------------------


class PolicyVersionError(TrioRLError, ValueError):
    """A policy version that would make the version cell go back, or is negative."""


# Engines -------------------------------------------------------------------------------------


class EngineError(TrioRLError):
    """Base class of every error an engine raises for one request.

    A group runner can tell "the engine gave up on this sample" from a bug in the caller.
    Messages name the server, the request id and what was wrong with the response.
    """


class EngineConfigError(EngineError, InvalidArgumentError):
    """A bad setting, refused when the object is built (not a request failure).

    The message names the class, the field and the bad value, e.g.
    ``SamplingParams.max_tokens must be an int >= 1, got 0``. It is a ``ValueError`` too.
    """


class EngineTransportError(EngineError):
    """The server could not be reached or kept failing (connection errors, 5xx) after retries."""


class EngineRequestError(EngineError):
    """The server refused the request (a 4xx status); retrying would not help.

    ``status_code`` is the HTTP status and ``body`` the start of the response body.
    """

    def __init__(self, message: str, *, status_code: int, body: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


class EngineAuthError(EngineRequestError):
    """The server refused the credentials sent (HTTP 401 or 403): a missing or wrong API key.

    Raised at once, by a health probe as by a request: waiting or retrying would not help. The
    message names the URL and the status, never the headers sent.
    """


class EngineResponseError(EngineError):
    """The server answered 2xx but the body is not a usable completion (bad JSON, a missing or
    ill-typed field, tokens and logprobs of different lengths). The message names the field."""


class EngineTimeoutError(EngineError):
    """A request did not finish within its deadline (it was aborted engine-side)."""


class SimulatedEngineError(EngineError):
    """A failure injected by :class:`~trio_rl.engines.SimulatedEngine` (``failure_rate``)."""


class ScriptedEngineError(EngineError):
    """The error a ``raise`` fate of :class:`~trio_rl.testing.ScriptedEngine` raises (a
    stand-in for a transport or engine failure)."""


# Environments --------------------------------------------------------------------------------


class EnvError(TrioRLError):
    """Base of the environment layer's errors (multi-turn episodes, tools)."""


class EnvConfigError(EnvError, ValueError):
    """An environment or episode setting that cannot be used (names the setting)."""


class EpisodeStoppedError(EnvError):
    """Raised inside an environment function when its episode ends before the function
    returns: a budget ran out (``max_turns``, ``budget``), a tool timed out or failed
    (``tool_timeout``, ``error``), or the function called ``episode.stop(reason)``. The episode
    runner catches it; an environment function lets it pass. ``reason`` is the stop reason,
    ``reward`` the episode's reward."""

    def __init__(self, reason: str, reward: float = 0.0, detail: str = "") -> None:
        super().__init__(f"the episode stopped: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason
        self.reward = reward
        self.detail = detail


class ToolCallSyntaxError(EnvError, ValueError):
    """The policy's text holds a tool call that does not parse (bad JSON, an unknown tool, bad
    arguments); a tool environment shows the message to the policy and goes on."""


class TemplateMismatchError(EnvError):
    """A chat template rendered an episode's conversation differently from the tokens the
    episode holds (it rewrites earlier turns): training the tokens would train text the model
    never saw. Raised with ``[env] on_mismatch = "fail"``."""


# Rollout -------------------------------------------------------------------------------------


class RolloutError(TrioRLError):
    """Base class of every error raised by :mod:`trio_rl.rollout`."""


class RolloutConfigError(RolloutError, InvalidArgumentError):
    """A bad setting, refused when the object is built (names the class, field and value)."""


class CreditError(RolloutError):
    """Credit accounting was violated (a credit returned twice, or for an unknown group).

    This always means a bug in a group runner or a custom driver: the library's own runners
    return exactly one credit per started sample.
    """


class DataSourceError(RolloutError):
    """A data source could not be read or restored (names the file, line and field)."""


class SourceExhaustedError(RolloutError):
    """The data source has no prompt left (and nothing recycled is waiting)."""


class FailureBudgetExceededError(RolloutError):
    """Too many groups failed (see ``FailurePolicy.max_consecutive_failures`` and
    ``SyncRolloutDriver.max_failures``); ``__cause__`` is the last :class:`GroupFailedError`.

    A group that fails the same way every time (an engine refusing every request) would
    otherwise be retried, or replaced by a new prompt, without bound.
    """


class RewardFailuresError(FailureBudgetExceededError):
    """A reward failed on every sample of its failure budget in a row (a step's worth by
    default): nothing can train, so the run stops. The message names the reward, the first
    failure's exception (the last line of its traceback), its record and the count."""


class DriverFailedError(RolloutError):
    """A fully-async driver stopped because its worker failed; ``__cause__`` says why.

    Once a driver has failed, every later ``next_batch`` raises this again.
    """


# Evaluation ----------------------------------------------------------------------------------


class EvalError(TrioRLError):
    """An evaluation could not give one honest figure: its samples came from more than one
    policy version, or its run directory's eval files are damaged (names the file and line)."""


class EvalConfigError(EvalError, ValueError):
    """A bad evaluation setting or input (an ``[eval]`` key, a held-out prompt file, weights
    that are not there), refused before anything runs; names what and where."""


# Payloads ------------------------------------------------------------------------------------


class WorkerError(TrioRLError):
    """Base class of the errors of :mod:`trio_rl.workers` (user code in worker processes or
    threads)."""


class WorkerStartError(WorkerError):
    """A worker could not be started, or could not load the function it runs (its module
    does not import there, or the function cannot be sent: a lambda, a closure)."""


class WorkerCallError(WorkerError):
    """The function raised in its worker. :attr:`line` is the last line of its traceback
    (``KeyError: 'answer'``), :attr:`where` the innermost frame (``rewards.py:12 in score``)."""

    def __init__(self, message: str, line: str, where: str) -> None:
        super().__init__(message)
        self.line = line
        self.where = where


class WorkerTimeoutError(WorkerError):
    """A call overran the pool's timeout: its worker process was killed (in thread mode the
    thread is abandoned and still runs)."""


class WorkerDiedError(WorkerError):
    """A worker process ended during a call (a crash, ``os._exit``, a signal)."""


class PayloadError(TrioRLError, OSError):
    """A by-handle payload file could not be read (short reads persisted, bad segment, ...)."""


class PayloadFileMissingError(PayloadError, FileNotFoundError):
    """A payload segment names a file that does not exist (read and deleted, or never written)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"payload file {path!r} does not exist")
        self.path = path


# Train ---------------------------------------------------------------------------------------


class TrainError(TrioRLError):
    """Base class of the train layer's errors; every bad input names what was wrong and where."""


class TrainSinkError(TrainError, ValueError):
    """A group, sample or counter handed to the sink was malformed; the sink state is unchanged."""


class CodecError(TrainError, ValueError):
    """A record does not have the expected shape or range.

    ``field`` is the path of the offending value (``sink.queued[2].logprobs``); the checkpoint
    reader adds the file and the byte offset of the record.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class CheckpointError(TrainError):
    """A checkpoint file is truncated, corrupt, of an unknown schema version or malformed.

    ``path`` names the file. Loading never executes code from the file (MessagePack, no pickle).
    """

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"checkpoint {path}: {message}")
        self.path = path


class CheckpointCompactionError(CheckpointError):
    """An incremental checkpoint's compaction (its newest delta rewritten as a full file)
    failed; ``path`` names the delta, ``__cause__`` is the failure. The deltas stay valid: every
    checkpoint written is still readable, only the chain is longer than it should be."""


# Publish -------------------------------------------------------------------------------------


class PublishError(TrioRLError):
    """Base class of every error the publication path raises."""


class PackingError(PublishError, ValueError):
    """A training sample that cannot be packed (inconsistent lengths, missing advantages)."""


class ReleaseTimeoutError(PublishError):
    """The deferred memory release of a shipped batch did not finish within its deadline."""


class MonitorTimeoutError(PublishError):
    """The monitor did not accept a ship record within its deadline."""


# Transport -----------------------------------------------------------------------------------


class TransportError(TrioRLError):
    """A batch transport failed: a bad message, a wrong step, a socket or file problem."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A transport wait passed its deadline (the READY barrier, a batch file that never came)."""


class TransportIOError(TransportError):
    """A file operation of the filesystem transport failed; ``path`` names the file."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class EndOfStreamError(TransportError):
    """The sender ended the stream: no step ``>= step`` will come (see ``end_stream``).

    Raised by a receive asked for a step at or past the end (again on every later receive).
    """

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


# Trainer -------------------------------------------------------------------------------------


class TensorConversionError(TrioRLError, ValueError):
    """A micro-batch whose fields disagree (lengths, byte sizes, dtypes); names the field."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        super().__init__(f"cannot convert micro-batch field {field!r} to a tensor: {reason}")


# Configuration ------------------------------------------------------------------------------


class ConfigError(TrioRLError, ValueError):
    """A configuration that cannot be used: a malformed TOML file, an unknown section or key, a
    value of the wrong type or out of range. ``where`` names the file and line (or the
    ``--set`` / flag it came from), ``key`` the dotted key (empty for a whole file)."""

    def __init__(self, where: str, key: str, message: str) -> None:
        super().__init__(f"{where}: {key + ': ' if key else ''}{message}")
        self.where = where
        self.key = key


class ConfigChangedError(ConfigError):
    """A resumed run's configuration differs from the one stored in its run directory in keys
    that were not allowed to change (``--allow-change``); ``changes`` lists them."""

    def __init__(self, where: str, changes: list[tuple[str, object, object]]) -> None:
        shown = ", ".join(f"{k} {_show(old)} -> {_show(new)}" for k, old, new in changes)
        keys = " ".join(f"--allow-change {k}" for k, _, _ in changes)
        super().__init__(
            where,
            "",
            f"the run's stored configuration differs: {shown}; resume with the stored values, "
            f"pass {keys} to accept, or use another --out",
        )
        self.changes = changes


def _show(value: object) -> str:
    return "unset" if value is None else repr(value)


# Operations tools (inspect, plot, metrics sinks) ---------------------------------------------


class ToolsError(TrioRLError):
    """Base class of the operations tools' errors (inspect, plot, metrics sinks)."""


class InspectError(ToolsError, ValueError):
    """``trio-rl inspect`` was given a path that is none of the things it reads; ``path``
    names it."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class MetricsFileError(ToolsError, ValueError):
    """A ``metrics.jsonl`` line is not a JSON object with a step; names the file, the line
    number and the line's byte offset."""

    def __init__(self, path: str, line: int, offset: int, reason: str) -> None:
        super().__init__(f"{path}: line {line} (byte offset {offset}): {reason}")
        self.path = path
        self.line = line
        self.offset = offset


class MissingExtraError(ToolsError, ImportError):
    """An optional dependency a tool needs is not installed; the message says which extra
    installs it."""

    def __init__(self, what: str, package: str, extra: str) -> None:
        super().__init__(f"{what} needs the {package!r} package (pip install 'trio-rl[{extra}]')")
        self.package = package
        self.extra = extra
