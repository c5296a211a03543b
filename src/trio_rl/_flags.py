"""The configuration flags of ``trio-rl run``, ``simulate`` and ``config``: each is a shorthand
for ``--set`` of one configuration path (``--max-off-policy-steps`` is
``--set sink.max_off_policy_steps=...``), so a knob is declared once, in its config class."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from .config import LearnRunConfig, Override, SimulateConfig, choices, env_overrides, flatten
from .engines import DISTRIBUTIONS
from .transport import transport_kinds


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


@attrs.frozen
class Flag:
    """A shorthand flag for ``--set key=value``."""

    flag: str
    key: str
    kwargs: dict[str, Any] = attrs.field(factory=dict)
    note: str = ""

    @property
    def dest(self) -> str:
        return "flag__" + self.key.replace(".", "__")


_POS_INT, _POS_FLOAT = _positive(int), _positive(float)


_STEPS = "steps this invocation ships, not a total: a resumed run ships this many more; "


SIMULATE_FLAGS = (
    Flag("--out", "run.out", {"type": str, "metavar": "DIR"}),
    Flag("--steps", "run.steps", {"type": _POS_INT}, _STEPS),
    Flag("--seed", "run.seed", {"type": int}),
    Flag("--batch-groups", "rollout.batch_groups", {"type": _POS_INT}),
    Flag("--group-size", "rollout.group_size", {"type": _POS_INT}),
    Flag("--submission", "rollout.submission"),
    Flag("--slots", "engine.slots", {"type": _POS_INT}),
    Flag("--distribution", "engine.distribution", {"choices": sorted(DISTRIBUTIONS)}),
    Flag("--tokens-per-second", "engine.tokens_per_second", {"type": _POS_FLOAT}),
    Flag("--max-tokens", "engine.max_tokens", {"type": _POS_INT}),
    Flag("--ranks", "trainer.ranks", {"type": _POS_INT}),
    # the choices are the registered transports, read when the parser is built
    Flag("--transport", "transport.kind", {"choices": transport_kinds}),
    Flag("--port", "transport.port", {"type": int}),
)


RUN_FLAGS = (
    Flag("--out", "run.out", {"type": str, "metavar": "DIR"}),
    Flag("--steps", "run.steps", {"type": int}, _STEPS),
    Flag(
        "--max-steps",
        "run.max_steps",
        {"type": int},
        "the run's last step, a total across resumes (--steps more, never past it); ",
    ),
    Flag("--seed", "run.seed", {"type": int}),
    Flag("--time-limit", "run.time_limit", {"type": float}),
    Flag("--stop-at-reward", "run.stop_at_reward", {"type": float}),
    Flag("--threads", "run.threads", {"type": int}),
    Flag(
        "--deterministic",
        "run.deterministic",
        {"action": "store_const", "const": True},
        "same seed, same rewards bit for bit (in-process trainer, one thread); ",
    ),
    Flag("--task", "rollout.task"),
    Flag("--batch-groups", "rollout.batch_groups", {"type": int}),
    Flag("--group-size", "rollout.group_size", {"type": int}),
    Flag("--max-async-level", "rollout.max_async_level", {"type": int}),
    Flag("--max-off-policy-steps", "sink.max_off_policy_steps", {"type": int}),
    Flag("--trainer", "trainer.mode"),
    Flag("--ranks", "trainer.ranks", {"type": int}),
    Flag("--lr", "trainer.lr", {"type": float}),
    Flag("--epochs", "trainer.epochs", {"type": int}),
    Flag("--trainer-delay", "trainer.delay", {"type": float}),
    Flag(
        "--no-plot",
        "metrics.plot",
        {"action": "store_const", "const": False},
        "do not draw RUN_DIR/plot.png at the end; ",
    ),
    Flag(
        "--plain",
        "metrics.display",
        {"action": "store_const", "const": "plain"},
        "one plain line per step, no live table or progress bar; ",
    ),
    Flag("--log-level", "run.log_level"),
)


def _metavar(f: Flag, schema: type[Any]) -> dict[str, Any]:
    if callable(f.kwargs.get("choices")):  # read now: e.g. the transports registered so far
        return {**f.kwargs, "choices": list(f.kwargs["choices"]())}
    if "choices" in f.kwargs or "metavar" in f.kwargs:
        return f.kwargs
    allowed = None if f.kwargs else choices(schema, f.key)
    if allowed is not None:  # the key's own list: the values are spelled once, in its type
        return {"choices": list(allowed)}
    return {"metavar": f.flag[2:].upper().replace("-", "_"), **f.kwargs}


def _unset_means(schema: type[Any], key: str) -> str:
    """What a key left unset does, for ``--help``: the ``(unset: ...)`` clause of its help
    (``runs/<YYYYmmdd-HHMMSS> under the current directory``), else ``unset``."""
    section, name = key.split(".", 1)
    owner = attrs.fields_dict(schema)[section].type
    cls = owner if isinstance(owner, type) else getattr(schema(), section).__class__
    text = " ".join(str(attrs.fields_dict(cls)[name].metadata.get("help", "")).split())
    start = text.find("(unset: ")
    if start < 0:
        return "unset"
    return "unset: " + text[start + len("(unset: ") :].split(")", 1)[0]


def add_config_arguments(
    p: argparse.ArgumentParser, schema: type[Any], flags: Sequence[Flag], resumable: bool
) -> None:
    p.add_argument(
        "configs",
        nargs="*",
        type=Path,
        metavar="CONFIG.toml",
        help="configuration files, later ones overriding earlier ones (`trio-rl config` prints "
        "the effective configuration; docs/operations.md lists every key)",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key (after the files and the flags below); repeatable",
    )
    if resumable:
        p.add_argument(
            "--allow-change",
            action="append",
            default=[],
            metavar="SECTION.KEY",
            help="let a resumed run change this key of the configuration stored in its run "
            "directory (a run is refused otherwise); repeatable",
        )
    defaults = flatten(schema())
    for f in flags:
        default = defaults[f.key]
        shown = _unset_means(schema, f.key) if default is None else default
        if "const" in f.kwargs:  # a switch: it sets one value, it has no default of its own
            const = f.kwargs["const"]
            value = str(const).lower() if isinstance(const, bool) else const
            text = f"{f.note}shorthand for --set {f.key}={value}"
        else:
            text = f"{f.note}shorthand for --set {f.key}=... (default {shown})"
        p.add_argument(
            f.flag,
            dest=f.dest,
            default=None,
            help=text,
            # the flag's name, not the dest, in the usage (choices show themselves)
            **_metavar(f, schema),
        )
    p.add_argument("-v", "--verbose", action="store_true", help="log more; tracebacks on errors")


def layers(schema: type[Any], args: argparse.Namespace, flags: Sequence[Flag]) -> list[Override]:
    """What overrides the files: the ``TRIO_RL_<SECTION>__<KEY>`` environment variables, then
    the flags, then ``--set``."""
    others = [s for s in (LearnRunConfig, SimulateConfig) if s is not schema]
    return [*env_overrides(schema, os.environ, others), *overrides(args, flags)]


def overrides(args: argparse.Namespace, flags: Sequence[Flag]) -> list[Override]:
    out = [
        Override(f.key, getattr(args, f.dest), where=f.flag)
        for f in flags
        if getattr(args, f.dest, None) is not None
    ]
    return out + [Override.parse(text) for text in args.sets]
