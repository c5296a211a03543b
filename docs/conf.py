"""Sphinx configuration for the trio-rl docs (MyST markdown pages, and the API reference
generated from the docstrings by autodoc)."""

project = "trio-rl"
author = "trio-rl developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "bench"]
myst_heading_anchors = 3
html_theme = "alabaster"
suppress_warnings = ["myst.xref_missing"]

# The docs session installs the package but not its optional or test dependencies: torch
# (``trio_rl.learn``, ``to_torch``) is imported lazily anyway, hypothesis by ``trio_rl.testing``.
autodoc_mock_imports = ["torch", "hypothesis"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
# Google-style "Args:" sections, as the docstrings write them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# A facade re-exports names of lower layers (``trio_rl.wire.PayloadSegment`` is
# ``trio_rl.payloads.PayloadSegment``): document each object once, under the documented module
# that defines it, so that references to it have one target.
_documented: list[str] = []
_current: list[str] = [""]


def _home(obj: object) -> str | None:
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str):
        return None
    homes = [m for m in _documented if module == m or module.startswith(m + ".")]
    return max(homes, key=len) if homes else None


def _note_module(app, what, name, obj, options, lines):  # type: ignore[no-untyped-def]
    if what == "module":
        _current[0] = name
        if name not in _documented:
            _documented.append(name)


def _skip_reexport(app, what, name, obj, skip, options):  # type: ignore[no-untyped-def]
    if what != "module" or skip:
        return None
    home = _home(obj)
    return True if home is not None and home != _current[0] else None


def _collect_documented(app, docname, source):  # type: ignore[no-untyped-def]
    import re

    for module in re.findall(r"^\.\. automodule:: (\S+)", source[0], flags=re.M):
        if module not in _documented:
            _documented.append(module)


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("source-read", _collect_documented)
    app.connect("autodoc-process-docstring", _note_module)
    app.connect("autodoc-skip-member", _skip_reexport)
