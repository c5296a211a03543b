"""A tiny random Llama directory for trying a run end to end without downloading anything."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError

__all__ = ["write_tiny_llama"]

#: The characters of the built-in tasks' prompts and answers (copy, repeat, reverse).
TASK_CHARS = "abcde123456="
#: The turns' contents one after the other, then ``=`` (only characters of the vocabulary).
_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


def write_tiny_llama(
    out: str | os.PathLike[str],
    *,
    chars: str = TASK_CHARS,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    max_positions: int = 64,
    tokenizer: bool = True,
) -> Path:
    """Write a random ``LlamaForCausalLM`` (float32, untied embeddings, head_dim 32: what
    vLLM's CPU build serves and reloads) and, with ``tokenizer``, a character tokenizer over
    ``chars`` (ids 0, 1, 2: ``<pad>``, ``<eos>``, ``<bos>``; a tiny chat template) to ``out``
    with ``save_pretrained``; returns the directory. Needs transformers and tokenizers
    (``trio-rl[transformers]``); nothing is downloaded."""
    if hidden % 32:
        raise InvalidArgumentError(f"hidden must be a multiple of the head size 32, got {hidden}")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # typed as Any: transformers' own annotations vary between its releases
    transformers: Any = importlib.import_module("transformers")
    transformers.utils.logging.disable_progress_bar()
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {c: 3 + i for i, c in enumerate(chars)}
    if tokenizer:
        hf = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        hf.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        hf.decoder = decoders.Fuse()  # characters back to text without separators
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=hf, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>"
        )
        fast.chat_template = _CHAT_TEMPLATE
        fast.save_pretrained(root)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        head_dim=32,  # vLLM's CPU attention rejects 16
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,  # tied: vLLM keeps the old lm_head on reload
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    transformers.LlamaForCausalLM(config).float().save_pretrained(root)
    return root
