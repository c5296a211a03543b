"""Sphinx configuration for the trio-rl docs (MyST markdown pages)."""

project = "trio-rl"
author = "trio-rl developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "bench"]
myst_heading_anchors = 3
html_theme = "alabaster"
suppress_warnings = ["myst.xref_missing"]
