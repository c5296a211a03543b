"""docs/contributing.md's recipe for a knob holds: a field added to a section's class (with
its default, check and ``metadata["help"]``) is a key of the TOML files, of ``--set``, of the
``TRIO_RL_<SECTION>__<KEY>`` environment, of ``trio-rl config`` and of the generated
reference, and reaches the library config it was declared in. The engine recipe is pinned by
tests/engines/test_engines_registry.py."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from trio_rl._validation import at_least
from trio_rl.config import ConfigError, Override, env_overrides, load, reference_markdown, to_toml
from trio_rl.config._load import option
from trio_rl.config._sections import EngineSection, config_section, engine_section
from trio_rl.engines import EngineKind
from trio_rl.engines._builtin import SIMULATED


@attrs.frozen
class ToyConfig:
    """A layer's config, as `RolloutConfig` is: the knobs its code reads."""

    width: int = attrs.field(default=3, validator=at_least(1), metadata={"help": "how wide"})


@attrs.frozen
class WiderToyConfig(ToyConfig):
    """The same config with one knob added: one field, its default, check and meaning."""

    depth: int = attrs.field(default=2, validator=at_least(1), metadata={"help": "how deep"})


@attrs.frozen
class OwnKeys:
    """A command's own section, as ``[run]`` is."""

    steps: int = option(5, "steps to run", validator=at_least(1))
    # the added knob of a hand-written section: one `option`
    patience: float = option(1.5, "seconds to wait", validator=at_least(0))


def _schema(config: type[Any]) -> type[Any]:
    toy_section = config_section(config, "ToySection", "The toy layer.")
    # an engine whose config class is ``config``: its knobs are keys of the engine section
    kind = EngineKind("toy", config, SIMULATED.open)

    @attrs.frozen
    class Keys(EngineSection):
        kind: str = option("toy", "the engine")

    engine_keys = engine_section("ToyEngine", "The toy engine.", base=Keys, kinds=(kind,))

    @attrs.frozen
    class Schema:
        toy: Any = attrs.field(factory=toy_section)
        own: OwnKeys = attrs.field(factory=OwnKeys)
        engine: Any = attrs.field(factory=engine_keys)

    return Schema


@pytest.mark.parametrize(
    ("key", "default", "given"),
    [("toy.depth", 2, 7), ("own.patience", 1.5, 0.25), ("engine.depth", 2, 9)],
)
def test_a_knob_added_to_a_section_class_is_a_key_everywhere(
    key: str, default: Any, given: Any
) -> None:
    schema = _schema(WiderToyConfig)
    section, name = key.split(".")
    # the files and the effective configuration (`trio-rl config` prints `to_toml`)
    assert f"{name} = {default}" in to_toml(schema())
    # --set, and the environment, each naming the key
    config, origin = load(schema, [], [Override.parse(f"{key}={given}")])
    assert getattr(getattr(config, section), name) == given
    assert origin[key] == "--set"
    env = env_overrides(schema, {f"TRIO_RL_{section.upper()}__{name.upper()}": str(given)})
    assert [o.key for o in env] == [key]
    # its check, with the loader's wording (where, which key)
    with pytest.raises(ConfigError, match=rf"--set: {section}\.{name}: .*must be >= "):
        load(schema, [], [Override.parse(f"{key}=-1")])
    # the reference of docs/operations.md, with its meaning
    assert f"| `{name}` |" in reference_markdown(schema)


def test_a_knob_added_to_a_library_config_reaches_it() -> None:
    config, _ = load(_schema(WiderToyConfig), [], [Override.parse("toy.depth=4")])
    assert config.toy.to_config() == WiderToyConfig(width=3, depth=4)
    engine, _ = load(_schema(WiderToyConfig), [], [Override.parse("engine.depth=6")])
    kind = engine.engine.kinds[0]
    assert engine.engine.engine_config(kind, "engine") == WiderToyConfig(width=3, depth=6)
    # and the section without it has no such key
    with pytest.raises(ConfigError, match="unknown key"):
        load(_schema(ToyConfig), [], [Override.parse("toy.depth=4")])
