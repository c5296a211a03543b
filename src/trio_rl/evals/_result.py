"""What one evaluation found: :class:`EvalResult` and its ``eval.jsonl`` record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from .._validation import at_least, one_of
from ..errors import EvalError

__all__ = ["EVAL_STATUSES", "EvalResult", "EvalStatus"]

#: ``done``: every planned prompt was evaluated; ``cut``: the eval's deadline passed first, the
#: figures are over the prompts that finished; ``dropped``: a run killed during the eval did not
#: redo it on resume (``on_resume = "drop"``), there are no figures.
EvalStatus = Literal["done", "cut", "dropped"]
EVAL_STATUSES: tuple[EvalStatus, ...] = ("done", "cut", "dropped")


def _fraction(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


@attrs.frozen
class EvalResult:
    """One evaluation of one policy version on held-out prompts, ``k`` samples each.

    ``step`` is the number of trained steps behind the evaluated policy (0: before training);
    ``policy_version`` the version that generated every sample (None when no sample produced
    a token). ``avg_at_k`` is the mean reward, ``pass_at_1`` and ``pass_at_k`` the unbiased
    pass@1 and pass@k, ``pass_hat_k`` pass^k (see :mod:`trio_rl.evals`), each over the
    ``prompts`` that finished (all ``k`` samples ended). ``truncated`` and ``failed`` are
    fractions of the ``samples``; ``completion_tokens_mean`` and ``turns_mean`` are per
    sample; ``wall_s`` is the eval's wall time in seconds.
    """

    step: int = attrs.field(validator=at_least(0))
    policy_version: int | None
    k: int = attrs.field(validator=at_least(1))
    status: EvalStatus = attrs.field(default="done", validator=one_of(EVAL_STATUSES))
    prompts: int = attrs.field(default=0, validator=at_least(0))
    prompts_planned: int = attrs.field(default=0, validator=at_least(0))
    samples: int = attrs.field(default=0, validator=at_least(0))
    avg_at_k: float | None = None
    pass_at_1: float | None = None
    pass_at_k: float | None = None
    pass_hat_k: float | None = None
    truncated: float | None = None
    failed: float | None = None
    completion_tokens_mean: float | None = None
    turns_mean: float | None = None
    temperature: float | None = None
    wall_s: float = 0.0

    def record(self) -> dict[str, Any]:
        """The ``eval.jsonl`` record: keys as users know them (``avg@8``, ``pass@1``,
        ``pass@8``, ``pass^8`` for ``k = 8``), in a fixed order."""
        k = self.k
        rec: dict[str, Any] = {
            "step": self.step,
            "policy_version": self.policy_version,
            "status": self.status,
            "k": k,
            f"avg@{k}": _fraction(self.avg_at_k),
            "pass@1": _fraction(self.pass_at_1),
        }
        if k != 1:
            rec[f"pass@{k}"] = _fraction(self.pass_at_k)
        rec[f"pass^{k}"] = _fraction(self.pass_hat_k)
        rec.update(
            prompts=self.prompts,
            prompts_planned=self.prompts_planned,
            samples=self.samples,
            truncated=_fraction(self.truncated),
            failed=_fraction(self.failed),
            completion_tokens_mean=_fraction(self.completion_tokens_mean),
            turns_mean=_fraction(self.turns_mean),
            temperature=self.temperature,
            wall_s=round(self.wall_s, 3),
        )
        return rec

    def sink_record(self) -> dict[str, Any]:
        """The record for the metrics sinks (TensorBoard, W&B, Prometheus): ``step`` and the
        figures under ``eval/`` (``eval/pass@8``; see ``trio_rl.tools.EVAL_FIELDS``). A
        figure the eval has none of is left out."""
        rec = self.record()
        out: dict[str, Any] = {"step": self.step}
        for key, value in rec.items():
            if key in ("step", "status", "k", "temperature", "prompts_planned"):
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"eval/{key}"] = value
        out["eval/cut"] = 1.0 if self.status == "cut" else 0.0
        return out

    @classmethod
    def from_record(cls, rec: Mapping[str, Any], where: str = "eval record") -> EvalResult:
        """The result an :meth:`record` wrote; :class:`~trio_rl.errors.EvalError` naming
        ``where`` if it is not one."""
        try:
            k = int(rec["k"])
            return cls(
                step=int(rec["step"]),
                policy_version=rec.get("policy_version"),
                k=k,
                status=rec.get("status", "done"),
                prompts=int(rec.get("prompts", 0)),
                prompts_planned=int(rec.get("prompts_planned", 0)),
                samples=int(rec.get("samples", 0)),
                avg_at_k=rec.get(f"avg@{k}"),
                pass_at_1=rec.get("pass@1"),
                pass_at_k=rec.get(f"pass@{k}", rec.get("pass@1") if k == 1 else None),
                pass_hat_k=rec.get(f"pass^{k}"),
                truncated=rec.get("truncated"),
                failed=rec.get("failed"),
                completion_tokens_mean=rec.get("completion_tokens_mean"),
                turns_mean=rec.get("turns_mean"),
                temperature=rec.get("temperature"),
                wall_s=float(rec.get("wall_s", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EvalError(f"{where}: not an eval record: {exc!r}") from None
