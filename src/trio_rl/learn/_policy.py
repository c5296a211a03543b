"""The policy of a run and how its records become prompts: the built-in character model of a
task, or a Hugging Face model directory (``[model] path``) loaded with transformers.

Either way the run sees one :class:`Policy`: a module ``forward(ids) -> logits`` whose
``state_dict`` is the one published as weights (for a Hugging Face model, exactly the model's
own keys, so a vLLM server serving the directory reloads them), the end-of-sequence id, the
longest sequence, and the record <-> text <-> tokens functions of its tokenizer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from ..envs import ChatTemplate
from ..errors import ConfigError
from ..rollout import DataSourceError
from ..samples import Prompt
from ._model import CharTransformer, ModelConfig
from ._task import EOS, TASKS

__all__ = ["HFCausalLM", "Policy", "check_model_dir", "load_policy", "record_prompts"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class HFCausalLM(nn.Module):
    """A transformers causal LM as ``forward(input_ids) -> logits``; its ``state_dict`` and
    ``load_state_dict`` are the wrapped model's own (no prefix), the names vLLM reloads."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.hf(input_ids=input_ids).logits
        return logits

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return self.hf.load_state_dict(state_dict, strict=strict, assign=assign)


@attrs.define(eq=False)
class Policy:
    """What a run needs of its model: see the module docstring."""

    model: nn.Module
    eos_token_id: int
    max_len: int
    #: record -> prompt token ids (``"prompt"`` text, or ``"messages"`` through the chat template)
    encode: Callable[[Mapping[str, Any]], tuple[int, ...]]
    #: completion token ids -> text (up to the end of sequence, special tokens dropped)
    decode: Callable[[Sequence[int]], str]
    #: the default completion cap (the task's longest answer plus ``<eos>``)
    max_tokens: int
    description: str
    #: text <-> token ids for the episodes' observations (``encode(text)``, ``decode(ids)``)
    codec: Any = None
    #: the tokenizer's chat template, rendered one message at a time (None: no chat template)
    chat: ChatTemplate | None = None


@attrs.frozen
class _TextCodec:
    """A Hugging Face tokenizer as an episode's text codec (no special tokens added)."""

    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def decode(self, tokens: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        return text


def check_model_dir(path: str | Path, where: str = "configuration") -> Path:
    """``path`` as a model directory with a config and a tokenizer, or the `ConfigError` that
    names what is missing (before any model is loaded)."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(where, "model.path", f"{root}: no such model directory")
    if not (root / "config.json").is_file():
        raise ConfigError(
            where, "model.path", f"{root}: not a Hugging Face model directory (no config.json)"
        )
    if not any((root / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(
            where,
            "model.path",
            f"{root}: the model directory has no tokenizer (none of "
            f"{', '.join(_TOKENIZER_FILES)}); save one there with tokenizer.save_pretrained",
        )
    return root


def _char_policy(task_name: str, seed: int, d_model: int, n_layers: int) -> Policy:
    task = TASKS[task_name]
    tokenizer = task.tokenizer
    torch.manual_seed(seed)
    model = CharTransformer(
        ModelConfig(
            tokenizer.vocab_size,
            d_model=d_model,
            n_layers=n_layers,
            max_len=task.max_prompt + task.max_answer + 1,
        )
    )

    def encode(record: Mapping[str, Any]) -> tuple[int, ...]:
        if "prompt" not in record:
            raise ValueError('the built-in character model takes "prompt" text only (no chat)')
        return tokenizer.encode(str(record["prompt"]))

    return Policy(
        model,
        EOS,
        model.cfg.max_len,
        encode,
        tokenizer.decode,
        task.max_answer + 1,
        f"task {task.name!r} ({task.description})",
        codec=tokenizer,
    )


def _hf_policy(path: str, where: str) -> Policy:
    root = check_model_dir(path, where)
    try:
        # typed as Any: transformers' own annotations vary between its releases
        transformers: Any = importlib.import_module("transformers")
    except ImportError:
        raise ConfigError(
            where,
            "model.path",
            "a model directory needs transformers (pip install 'trio-rl[transformers]')",
        ) from None
    transformers.utils.logging.disable_progress_bar()  # one line per step is the run's own output
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as exc:
        detail = " ".join(str(exc).split())[:200]
        raise ConfigError(
            where, "model.path", f"{root}: the tokenizer does not load: {detail}"
        ) from None
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(root), local_files_only=True, dtype=torch.float32
        )
    except Exception as exc:
        detail = " ".join(str(exc).split())[:200]
        raise ConfigError(
            where, "model.path", f"{root}: the model does not load: {detail}"
        ) from None
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else hf.config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    if eos is None:
        raise ConfigError(
            where, "model.path", f"{root}: neither the tokenizer nor the config names an eos token"
        )

    def encode(record: Mapping[str, Any]) -> tuple[int, ...]:
        if record.get("messages") is not None:
            text: str = tokenizer.apply_chat_template(
                list(record["messages"]), tokenize=False, add_generation_prompt=True
            )
            return tuple(tokenizer.encode(text, add_special_tokens=False))
        return tuple(tokenizer.encode(str(record["prompt"])))

    def decode(tokens: Sequence[int]) -> str:
        text: str = tokenizer.decode(list(tokens), skip_special_tokens=True)
        return text

    hf.eval()
    max_len = int(getattr(hf.config, "max_position_embeddings", 0) or 2048)
    chat = ChatTemplate(tokenizer, int(eos)) if getattr(tokenizer, "chat_template", None) else None
    return Policy(
        HFCausalLM(hf),
        int(eos),
        max_len,
        encode,
        decode,
        32,
        f"model {root}",
        codec=chat if chat is not None else _TextCodec(tokenizer),
        chat=chat,
    )


def load_policy(
    *,
    model_path: str | None,
    task: str,
    seed: int,
    d_model: int,
    n_layers: int,
    where: str = "configuration",
) -> Policy:
    """The run's initial policy: the model directory's, or the task's character model seeded by
    ``seed`` (every process builds the same one)."""
    if model_path is not None:
        torch.manual_seed(seed)
        return _hf_policy(model_path, where)
    return _char_policy(task, seed, d_model, n_layers)


def record_prompts(
    records: Sequence[Mapping[str, Any]], policy: Policy, where: str, max_tokens: int
) -> list[Prompt]:
    """Every record as a prompt (its tokens from ``policy.encode``, the record as its label).
    Raises :class:`~trio_rl.rollout.DataSourceError` naming ``where`` and the record that does
    not render or does not fit the model with ``max_tokens``."""
    prompts = []
    for i, record in enumerate(records):
        try:
            tokens = policy.encode(record)
        except Exception as exc:
            detail = " ".join(str(exc).split())[:200]
            raise DataSourceError(
                f"{where}, record {i + 1}: cannot be tokenized: {detail}"
            ) from None
        if not tokens:
            raise DataSourceError(f"{where}, record {i + 1}: the prompt has no tokens")
        if len(tokens) + max_tokens > policy.max_len:
            raise DataSourceError(
                f"{where}, record {i + 1}: {len(tokens)} prompt tokens + max_tokens {max_tokens} "
                f"exceed the model's {policy.max_len} positions"
            )
        prompts.append(Prompt(key=f"r{i}", tokens=tokens, label=dict(record)))
    return prompts
