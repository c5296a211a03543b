"""``write_tiny_llama``: the model directory the vLLM runs serve, written quietly."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from trio_rl.errors import InvalidArgumentError
from trio_rl.learn import write_tiny_llama

# typed as Any: transformers' own annotations vary between its releases
transformers: Any = importlib.import_module("transformers")


def test_writing_the_model_prints_no_progress_bar(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """transformers draws a tqdm "Writing model shards" bar on stderr per ``save_pretrained``;
    between a run's one line per step it reads as noise, so the writer turns it off."""
    transformers.utils.logging.enable_progress_bar()  # as a fresh process has it
    out = write_tiny_llama(tmp_path / "model", chars="abc")
    printed = "".join(capfd.readouterr())
    assert "Writing model shards" not in printed
    assert "%|" not in printed  # no tqdm bar of any name
    config = json.loads((out / "config.json").read_text())
    assert (config["tie_word_embeddings"], config["head_dim"]) == (False, 32)
    assert (out / "tokenizer.json").is_file()


def test_a_hidden_size_off_the_head_size_is_an_invalid_argument(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="hidden must be a multiple of the head size"):
        write_tiny_llama(tmp_path / "model", hidden=33)
    assert not (tmp_path / "model").exists(), "refused before anything is written"
