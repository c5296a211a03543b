"""Tiny Hugging Face model directories for the tests (`trio_rl.learn.write_tiny_llama`: a
random Llama written with ``save_pretrained`` and a character tokenizer built locally)."""

from __future__ import annotations

from trio_rl.learn import write_tiny_llama

__all__ = ["write_tiny_llama"]
