"""Tiny Hugging Face model directories for the tests: a random Llama written with
``save_pretrained`` (untied embeddings, head_dim 32, float32, what vLLM's CPU build serves and
reloads) and a character tokenizer built locally with ``tokenizers`` (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

#: The tokenizer's characters after <pad> (0), <eos> (1) and <bos> (2).
CHARS = "abcde123456="
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}={{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


def write_tiny_llama(
    out: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, tokenizer: bool = True
) -> Path:
    """Write the model (and, with ``tokenizer``, its tokenizer) to ``out``; returns ``out``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging

    logging.disable_progress_bar()

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {c: 3 + i for i, c in enumerate(CHARS)}
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        hf = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        hf.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        fast = PreTrainedTokenizerFast(
            tokenizer_object=hf, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>"
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).float().save_pretrained(out)
    return out
