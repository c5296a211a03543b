"""docs/migrating.md ("Coming from miles or prime-rl") cites only what exists.

Every ``trio_rl.…`` dotted name on the page must import (the longest importable module prefix,
then ``getattr`` for the rest; an attrs field counts as an attribute of its class), and every
configuration key, written ``[section] key``, ``--set section.key=...``, in a ``toml`` code block
(or a backticked ``section.key`` whose section is a configuration section), must be a field of
``trio-rl run``'s or ``trio-rl simulate``'s configuration. A rename anywhere then fails here
instead of leaving the page wrong. The page must also keep covering the reference knobs and
behaviours a user coming from miles or prime-rl looks for.
"""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path
from typing import Any

import attrs
import pytest

from trio_rl.config import LearnRunConfig, SimulateConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
INDEX = PAGE.with_name("index.md")

_DOTTED = re.compile(r"\btrio_rl(?:\.[A-Za-z_]\w*)+")
_BRACKET_KEY = re.compile(r"\[([a-z_]+)\] ([a-z_]+)`")
_SET_KEY = re.compile(r"--set ([a-z_]+)\.([a-z_]+)=")
_CODE = re.compile(r"`([^`\n]+)`")
_DOT_KEY = re.compile(r"([a-z_]+)\.([a-z_]+)")
_TOML_BLOCK = re.compile(r"^```toml\n(.*?)^```", re.S | re.M)

# What the page must keep mapping: every reference knob and behaviour a migrating user would
# look for.
REQUIRED = [
    "--rollout-batch-size",
    "--n-samples-per-prompt",
    "--fully-async",
    "--rollout-submission-granularity",
    "--over-sampling-batch-size",
    "--partial-rollout",
    "--mask-offpolicy-in-partial-rollout",
    "--async-max-concurrent-samples",
    "--async-data-buffer-capacity-factor",
    "--async-unused-samples-handler",
    "--max-weight-staleness",
    "--dynamic-sampling-filter-path",
    "consistent_hashing",
    "reset_for_retry",
    "max_off_policy_steps",
    "TARGET_LAG",
    "batch_size",
    "token_batch_size",
    "constant_trainer_batch_size",
    "rollout_transport",
    "ZMQTransportConfig",
    "exactly-once",
    "staleness rule",
    "aborted",
    "retried attempts",
    "end of stream",
    "READY barrier",
    "filesystem layout",
    "payload segments",
    "publication metrics (#3806)",
]


def _sections(schema: type[Any]) -> dict[str, set[str]]:
    instance = schema()
    return {
        section.name: set(attrs.fields_dict(type(getattr(instance, section.name))))
        for section in attrs.fields(schema)
    }


def _config_keys() -> dict[str, set[str]]:
    keys: dict[str, set[str]] = {}
    for schema in (LearnRunConfig, SimulateConfig):
        for section, names in _sections(schema).items():
            keys.setdefault(section, set()).update(names)
    return keys


def resolve(name: str) -> object:
    """Import the longest module prefix of ``name`` and ``getattr`` the rest; LookupError if it
    does not resolve."""
    parts = name.split(".")
    obj: object = None
    rest: list[str] = []
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not module.startswith(exc.name):
                raise  # the module exists but one of its imports is missing
            continue
        rest = parts[i:]
        break
    else:
        raise LookupError(f"{name}: no importable module prefix")
    for attr in rest:
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif isinstance(obj, type) and attrs.has(obj) and attr in attrs.fields_dict(obj):
            obj = attrs.fields_dict(obj)[attr]
        else:
            raise LookupError(f"{name}: {obj!r} has no attribute {attr!r}")
    return obj


def cited_names(text: str) -> set[str]:
    return set(_DOTTED.findall(text))


def cited_keys(text: str, sections: set[str]) -> set[tuple[str, str]]:
    keys = set(_BRACKET_KEY.findall(text)) | set(_SET_KEY.findall(text))
    for block in _TOML_BLOCK.findall(text):
        for section, values in tomllib.loads(block).items():
            keys.update((section, key) for key in values)
    for code in _CODE.findall(text):
        match = _DOT_KEY.fullmatch(code)
        if match and match.group(1) in sections:
            keys.add((match.group(1), match.group(2)))
    return keys


def unknown_keys(keys: set[tuple[str, str]], known: dict[str, set[str]]) -> list[str]:
    return sorted(f"[{s}] {k}" for s, k in keys if k not in known.get(s, set()))


def unresolved(names: set[str]) -> list[str]:
    bad = []
    for name in sorted(names):
        try:
            resolve(name)
        except (LookupError, ImportError) as exc:
            bad.append(str(exc))
    return bad


@pytest.fixture(scope="module")
def page() -> str:
    assert PAGE.exists(), f"{PAGE} is missing"
    return PAGE.read_text()


def test_every_cited_api_name_exists(page: str) -> None:
    names = cited_names(page)
    assert len(names) >= 60, f"only {len(names)} trio_rl names found: is the extraction broken?"
    assert unresolved(names) == []


def test_every_cited_config_key_exists(page: str) -> None:
    known = _config_keys()
    keys = cited_keys(page, set(known))
    assert len(keys) >= 12, f"only {len(keys)} configuration keys found: {sorted(keys)}"
    assert unknown_keys(keys, known) == []


def test_the_checks_catch_a_wrong_name_and_a_wrong_key() -> None:
    text = (
        "`trio_rl.rollout.SyncRolloutDriver` and `trio_rl.rollout.NoSuchDriver`, "
        "`trio_rl.no_such_module.Thing`, `trio_rl.sink.SinkConfig.staleness`, "
        "`trio_rl.sink.SinkConfig.no_such_field`; keys `[sink] max_off_policy_steps`, "
        "`[sink] no_such_key`, `--set rollout.no_such_knob=1`, `transport.kind`, "
        "`nosection.key`, `[nosection] key`\n"
        "```toml\n[trainer]\nranks = 2\nno_such_option = 1\n```\n"
    )
    bad = unresolved(cited_names(text))
    assert [message.split(":", 1)[0] for message in bad] == [
        "trio_rl.no_such_module.Thing",
        "trio_rl.rollout.NoSuchDriver",
        "trio_rl.sink.SinkConfig.no_such_field",
    ]
    known = _config_keys()
    keys = cited_keys(text, set(known))
    assert ("transport", "kind") in keys  # a backticked section.key
    assert ("nosection", "key") in keys  # a [section] key, whatever the section
    assert ("trainer", "ranks") in keys  # a key in a TOML block
    assert unknown_keys(keys, known) == [
        "[nosection] key",
        "[rollout] no_such_knob",
        "[sink] no_such_key",
        "[trainer] no_such_option",
    ]


def test_the_page_maps_every_reference_knob_and_behaviour(page: str) -> None:
    lowered = page.lower()
    missing = [item for item in REQUIRED if item.lower() not in lowered]
    assert missing == []


def test_the_page_is_in_the_toctree() -> None:
    toctree = INDEX.read_text().split("```{toctree}", 1)[1].split("```", 1)[0]
    assert "migrating" in toctree.split()
