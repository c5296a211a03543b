"""Metrics sinks: one record per shipped step, written to JSONL and any number of adapters.

A record is a flat ``dict`` with at least ``"step"``; :data:`FIELDS` lists the standard fields
(what the learning run writes to ``metrics.jsonl``). Every sink takes the same records:
:class:`JsonlSink` (the single source of truth: ``trio-rl plot`` and ``trio-rl inspect`` read
it), :class:`~trio_rl.tools.console.ConsoleDisplay`, and the optional adapters
:class:`TensorBoardSink` (``trio-rl[tensorboard]``), :class:`WandbSink` (``trio-rl[wandb]``)
and :class:`PrometheusSink` (``trio-rl[prometheus]``). :class:`FanOut` feeds several.

Sinks are synchronous and may block on I/O (a file write, a W&B queue): from trio, call
``write`` in a worker thread (``trio.to_thread.run_sync``), never on the event loop.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from .._durable import atomic_write
from ..publish import step_record
from ..rundir import RunDirectory
from ._errors import MetricsFileError, MissingExtraError

__all__ = [
    "ALL_FIELDS",
    "EVAL_FIELDS",
    "FIELDS",
    "FanOut",
    "JsonlSink",
    "MetricsSink",
    "PrometheusSink",
    "TRAINER_FIELDS",
    "TensorBoardSink",
    "WANDB_ID_FILE",
    "WandbSink",
    "numeric_fields",
    "open_sinks",
    "read_metrics",
    "step_record",
]

#: The standard fields of a metrics record and what they mean. Records may hold more; the
#: adapters export every numeric field, the console and the plots use these.
FIELDS: Mapping[str, str] = {
    "step": "the shipped step (batch) the record describes",
    "reward_mean": "mean reward of the samples scored for this step (null if none)",
    "reward_count": "samples scored (shipped or pruned) for this step",
    "samples": "samples shipped in this step's batch",
    "tokens": "tokens shipped in this step's batch",
    "samples_per_s": "samples scored per second since the previous step",
    "tokens_per_s": "tokens shipped per second since the previous step",
    "slot_occupancy": (
        "busy fraction of the engine's decode slots since the previous step "
        "(TorchEngine: of its max_batch rows)"
    ),
    "loop_lag_p95_ms": "95th percentile of the event loop's scheduling lag (ms)",
    "queue_depth": "training samples queued in the sink after the step shipped",
    "off_policy_max": "largest off-policy lag (versions) of a shipped sample",
    "policy_version": "the policy version current when the step shipped",
    "stale": "samples dropped as too stale for this step",
    "pruned": "samples pruned (zero advantage) for this step",
    "policy_wait_s": "seconds the ship gate waited for the policy version",
    "wall_s": "seconds since the run started",
    "waste": (
        "fraction of the samples settled for this step that will never train (stale, "
        "cancelled, failed, filtered; pruned ones excluded)"
    ),
    "waste_total": "the same fraction over the run so far, of every dispatched sample",
    "cancelled_stale": "samples cancelled while generating because they could no longer train",
}

#: The trainer's fields of a record (the trainer's report of a trained step, in the same record
#: stream as the orchestrator's fields): every sink exports them like the others, TensorBoard and
#: W&B under their own ``trainer/`` section, Prometheus as ``trio_rl_trainer_<name>``.
TRAINER_FIELDS: Mapping[str, str] = {
    "trainer/loss": "the trainer's policy loss of the step (mean over its updates)",
    "trainer/clip_frac": "fraction of tokens whose importance ratio was clipped",
    "trainer/ratio_mean": "mean importance ratio (new policy / behaviour policy) over tokens",
    "trainer/kl": "KL divergence to the behaviour policy (k3 estimator), mean over tokens",
    "trainer/entropy": "the policy's entropy over the trained tokens (nats)",
    "trainer/grad_norm": "gradient norm before clipping",
    "trainer/lr": "the learning rate of the step",
    "trainer/tokens_per_s": "tokens trained per second",
}

#: The fields of an eval's record in the sinks (one record per eval, at the eval's step: the
#: trained steps behind the evaluated policy), ``k`` standing for the eval's samples per prompt
#: (``eval/pass@8``). W&B shows them as an ``eval/`` section; TensorBoard too, with ``@``
#: written ``_at_`` and ``^`` written ``_hat_`` (``eval/pass_at_8``: it allows neither); and
#: Prometheus as ``trio_rl_eval_<name>``, spelled the same way (``trio_rl_eval_pass_hat_8``).
#: ``eval.jsonl`` holds the same figures without the prefix.
EVAL_FIELDS: Mapping[str, str] = {
    "eval/avg@k": "mean reward of the eval's samples, k per held-out prompt",
    "eval/pass@1": "unbiased pass@1: the chance one sample is correct, mean over prompts",
    "eval/pass@k": "unbiased pass@k (Codex estimator): at least one of k samples correct",
    "eval/pass^k": "pass^k: all k samples correct, mean over prompts",
    "eval/prompts": "held-out prompts evaluated (all k samples ended)",
    "eval/samples": "samples generated by the eval",
    "eval/truncated": "fraction of the eval's samples cut at max_tokens",
    "eval/failed": "fraction of the eval's samples whose generation or reward failed",
    "eval/completion_tokens_mean": "mean completion tokens per sample",
    "eval/turns_mean": "mean turns per sample (1 without an environment)",
    "eval/policy_version": "the one policy version that generated every sample",
    "eval/wall_s": "the eval's wall time (s)",
    "eval/cut": "1 when the eval's deadline cut it short (figures over the prompts that ended)",
}

#: Where a run directory keeps the id of its W&B run (a resumed run continues it).
WANDB_ID_FILE = "wandb/run_id"

#: Every documented field: the orchestrator's, then the trainer's.
ALL_FIELDS: Mapping[str, str] = {**FIELDS, **TRAINER_FIELDS}


@runtime_checkable
class MetricsSink(Protocol):
    """Where metrics records go: ``write`` one record per step, ``close`` once at the end."""

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


#: Record fields TensorBoard shows as sections of their own (not under the run's prefix).
_OWN_SECTIONS = ("trainer/", "eval/")


def _gauge_name(key: str) -> str:
    """A Prometheus metric name for a record field: ``eval/pass@8`` -> ``eval_pass_at_8``
    (``pass@8`` and ``pass^8`` must not both become ``pass_8``)."""
    key = key.replace("@", "_at_").replace("^", "_hat_")
    return "".join(c if c.isalnum() else "_" for c in key)


def numeric_fields(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's finite numeric fields (bools and nulls left out), as floats."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def _step_of(record: Mapping[str, Any]) -> int:
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"a metrics record needs an int 'step', got {step!r}")
    return step


class JsonlSink:
    """Appends each record as one JSON line to ``path`` (created with its directory).

    Each line is written with one ``write`` call and flushed, so a reader tailing the file
    sees whole lines; ``fsync`` also forces each line to disk. A NaN or infinite value is
    written as null (JSON has neither).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: Mapping[str, Any]) -> None:
        _step_of(record)
        # JSON has no NaN or infinity: such a value is written as null (no value this step)
        clean = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in record.items()
        }
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order.

    A last line without its newline is a write in progress (a run still writing, or killed
    mid-line) and is left out; any other line that is not a JSON object with an int ``step``
    raises :class:`MetricsFileError` naming the file, the line and its byte offset.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise MetricsFileError(str(p), 0, 0, f"cannot read: {exc.strerror or exc}") from exc
    records: list[dict[str, Any]] = []
    offset = 0
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        start, offset = offset, offset + len(raw) + 1
        if number == len(lines):
            break  # after the last newline: empty, or a line still being written
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MetricsFileError(str(p), number, start, f"not JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise MetricsFileError(str(p), number, start, "not a JSON object")
        try:
            _step_of(obj)
        except ValueError as exc:
            raise MetricsFileError(str(p), number, start, str(exc)) from exc
        records.append(obj)
    return records


class FanOut:
    """Writes every record to each of ``sinks`` in order; ``close`` closes them all (the first
    error is raised after every sink was asked to close)."""

    def __init__(self, sinks: Iterable[MetricsSink]) -> None:
        self.sinks: Sequence[MetricsSink] = tuple(sinks)

    def write(self, record: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        errors: list[Exception] = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


class TensorBoardSink:
    """Every numeric field as a TensorBoard scalar ``<prefix>/<field>`` at the record's step; a
    field of the trainer's or the evals' section (``trainer/loss``, ``eval/pass@8``: see
    :data:`TRAINER_FIELDS`, :data:`EVAL_FIELDS`) keeps its own name, so TensorBoard shows them
    as sections of their own.

    Uses ``tensorboardX`` (``trio-rl[tensorboard]``), or ``torch.utils.tensorboard`` when only
    the ``tensorboard`` package is installed.
    """

    def __init__(self, logdir: str | os.PathLike[str], *, prefix: str = "trio_rl") -> None:
        module: Any = None
        for name in ("tensorboardX", "torch.utils.tensorboard"):
            try:
                module = importlib.import_module(name)
                break
            except ImportError:
                continue
        if module is None:
            raise MissingExtraError("the TensorBoard sink", "tensorboardX", "tensorboard")
        self.logdir = Path(logdir)
        self._prefix = prefix
        self._writer = module.SummaryWriter(logdir=str(self.logdir))

    def write(self, record: Mapping[str, Any]) -> None:
        step = _step_of(record)
        for key, value in numeric_fields(record).items():
            if key == "step":
                continue
            tag = key if key.startswith(_OWN_SECTIONS) else f"{self._prefix}/{key}"
            # TensorBoard writes a character outside [-/\w.] as "_": pass@8 and pass^8 would
            # be one series
            tag = tag.replace("@", "_at_").replace("^", "_hat_")
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Every numeric field logged to a Weights & Biases run, against the record's ``step``.

    ``init`` is passed to ``wandb.init`` (``project``, ``name``, ``entity``, ``tags``,
    ``config``, ``dir``, ``mode``; ``WANDB_MODE=offline`` writes the run locally for ``wandb
    sync``). Needs ``trio-rl[wandb]``.

    ``step`` is the x axis of every chart (``define_metric("*", step_metric="step")``), not
    W&B's own row counter: a record may arrive for a step older than one already logged (the
    trainer reports a step after the orchestrator shipped the next), which W&B would drop if it
    were logged with ``step=``.

    ``id_file``: where the run's id is kept (the run directory's ``wandb/run_id``). With
    ``resume`` and an id there, the run continues that W&B run (``resume="allow"``); the id of
    the run opened is written there either way.
    """

    def __init__(
        self, *, id_file: str | os.PathLike[str] | None = None, resume: bool = False, **init: Any
    ) -> None:
        try:
            wandb = importlib.import_module("wandb")
        except ImportError:
            raise MissingExtraError("the Weights & Biases sink", "wandb", "wandb") from None
        self._wandb = wandb
        self.id_file = None if id_file is None else Path(id_file)
        if self.id_file is not None and resume and "id" not in init:
            try:
                known = self.id_file.read_text(encoding="utf-8").strip()
            except FileNotFoundError:
                known = ""
            if known:
                init = {"id": known, "resume": "allow", **init}
        self._run = wandb.init(**init)
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        if self.id_file is not None:
            self.id_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.id_file, str(self._run.id) + "\n")

    @property
    def run(self) -> Any:
        """The ``wandb`` run (its ``dir``, ``id``, ...)."""
        return self._run

    def write(self, record: Mapping[str, Any]) -> None:
        _step_of(record)
        self._run.log(numeric_fields(record))

    def close(self) -> None:
        """Finish the run; when no other W&B run is active, also shut wandb's service down:
        ``finish`` can return before the service has written the run file (seen offline)."""
        self._run.finish()
        if self._wandb.run is None:
            self._wandb.teardown()


class PrometheusSink:
    """Serves the latest record's numeric fields as Prometheus gauges ``<prefix>_<field>`` on
    ``http://<host>:<port>/metrics`` (port 0 picks a free one: see :attr:`port`).

    A registry of its own (not the process-global one), so several sinks and tests coexist.
    The HTTP server runs in a daemon thread until :meth:`close`. Needs
    ``trio-rl[prometheus]``.
    """

    def __init__(self, port: int = 0, *, host: str = "127.0.0.1", prefix: str = "trio_rl") -> None:
        try:
            prometheus_client = importlib.import_module("prometheus_client")
        except ImportError:
            raise MissingExtraError(
                "the Prometheus endpoint", "prometheus_client", "prometheus"
            ) from None
        self._prom = prometheus_client
        self._registry = prometheus_client.CollectorRegistry()
        self._prefix = prefix
        self._gauges: dict[str, Any] = {}
        self._server, self._thread = prometheus_client.start_http_server(
            port, addr=host, registry=self._registry
        )
        self.host = host

    @property
    def port(self) -> int:
        """The port the endpoint listens on."""
        return int(self._server.server_port)

    def write(self, record: Mapping[str, Any]) -> None:
        _step_of(record)
        for key, value in numeric_fields(record).items():
            gauge = self._gauges.get(key)
            if gauge is None:
                name = f"{self._prefix}_{_gauge_name(key)}"
                doc = ALL_FIELDS.get(key, f"the metrics record's {key!r} field")
                gauge = self._prom.Gauge(name, doc, registry=self._registry)
                self._gauges[key] = gauge
            gauge.set(value)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def open_sinks(
    run_dir: str | os.PathLike[str],
    *,
    console: bool = True,
    plain: bool | None = None,
    stream: IO[str] | None = None,
    tensorboard: bool = False,
    wandb: Mapping[str, Any] | None = None,
    prometheus_port: int | None = None,
) -> FanOut:
    """Every sink a run writes to: ``<run_dir>/metrics.jsonl`` always; the console display
    (``console``, ``plain``, ``stream`` as for :class:`~trio_rl.tools.console.ConsoleDisplay`);
    TensorBoard under ``<run_dir>/tensorboard``; a W&B run (``wandb``: ``wandb.init``
    arguments, its ``dir`` defaulting to the run directory); a Prometheus endpoint on
    ``prometheus_port`` (0: a free port). A sink whose extra is missing raises
    :class:`MissingExtraError` after the ones already opened are closed.
    """
    from .console import ConsoleDisplay

    root = RunDirectory(run_dir)
    sinks: list[MetricsSink] = []
    try:
        sinks.append(JsonlSink(root.metrics))
        if console:
            sinks.append(ConsoleDisplay(stream, plain=plain))
        if tensorboard:
            sinks.append(TensorBoardSink(root.tensorboard))
        if wandb is not None:
            sinks.append(
                WandbSink(**{"dir": str(root.root), "id_file": root.root / WANDB_ID_FILE, **wandb})
            )
        if prometheus_port is not None:
            sinks.append(PrometheusSink(prometheus_port))
    except BaseException:
        FanOut(sinks).close()
        raise
    return FanOut(sinks)
