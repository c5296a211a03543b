"""Weight publication: versioned safetensors directories, written atomically, the last K kept.

Layout under the weights root::

    step_<S>/model.safetensors   the state dict of policy version S
    step_<S>/meta.json           {"version": S, "format": "safetensors", "files": [...]}

A directory appears under its final name only once both files are complete and flushed (it is
written as ``.tmp-step_<S>-<pid>`` and renamed), so a reader that sees ``step_<S>/meta.json``
can load it. The directory is what a vLLM server's weight-reload endpoint takes:
``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import save_file

from .._validation import check_at_least
from ..engines import WEIGHTS_FILE

__all__ = [
    "META_FILE",
    "WEIGHTS_FILE",
    "PublishedWeights",
    "latest_weights",
    "publish_weights",
    "published_weights",
]

META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@attrs.frozen
class PublishedWeights:
    version: int
    path: Path
    """The ``step_<S>`` directory."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_weights(
    root: str | os.PathLike[str],
    version: int,
    state_dict: Mapping[str, torch.Tensor],
    *,
    keep: int = 3,
    meta: Mapping[str, Any] | None = None,
) -> PublishedWeights:
    """Write ``state_dict`` as policy ``version`` under ``root`` and keep the newest ``keep``.

    Synchronous file I/O: call it from a worker thread. A version published again (a resumed
    trainer) replaces the old directory.
    """
    check_at_least("keep", keep, 1)
    check_at_least("version", version, 0)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{version}"
    tmp = root / f".tmp-step_{version}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"version": str(version)})
    info = {"version": version, "format": "safetensors", "files": [WEIGHTS_FILE], **(meta or {})}
    (tmp / META_FILE).write_text(json.dumps(info))
    for name in (WEIGHTS_FILE, META_FILE):
        _fsync(tmp / name)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(root)
    for old in sorted(_published(root), key=lambda w: w.version)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    return PublishedWeights(version, final)


def _published(root: Path) -> list[PublishedWeights]:
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append(PublishedWeights(int(m.group(1)), Path(entry.path)))
    return found


def published_weights(root: str | os.PathLike[str]) -> list[PublishedWeights]:
    """Every complete published version under ``root``, oldest first."""
    return sorted(_published(Path(root)), key=lambda w: w.version)


def latest_weights(root: str | os.PathLike[str]) -> PublishedWeights | None:
    """The newest complete published version under ``root``, or None."""
    published = _published(Path(root))
    return max(published, key=lambda w: w.version) if published else None
