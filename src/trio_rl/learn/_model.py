"""A tiny character-level causal transformer: the policy of the built-in learning run."""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CharTransformer", "ModelConfig", "sequence_logprobs", "sequence_logprobs_entropy"]


@attrs.frozen
class ModelConfig:
    """The shape of a :class:`CharTransformer` (the defaults have about 200k parameters)."""

    vocab_size: int
    d_model: int = 64
    n_layers: int = 3
    n_heads: int = 4
    d_ff: int = 256
    max_len: int = 48


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ff = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.ff(self.ln2(x))
        return out


class CharTransformer(nn.Module):
    """``forward(input_ids [B, T]) -> logits [B, T, vocab]``; positions start at 0 per row.

    Right padding is harmless: attention is causal, so a row's real tokens never see it.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
        # a near-uniform start: every reply is a random string, so the first reward is ~0
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        for block in self.blocks:
            assert isinstance(block, _Block)
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.cfg.max_len:
            raise ValueError(
                f"sequence of {t} tokens exceeds the model's max_len {self.cfg.max_len}"
            )
        positions = torch.arange(t, device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)[None]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def sequence_logprobs(
    model: nn.Module, sequences: list[torch.Tensor], temperature: float = 1.0
) -> list[torch.Tensor]:
    """Per-token logprobs of each 1-D token sequence under ``model`` (entry 0 of each is 0.0).

    Entry ``i`` is ``log p(tokens[i] | tokens[:i])`` at ``temperature``: what an engine reports
    for a sampled token. Sequences are right-padded into one batch.
    """
    if not sequences:
        return []
    longest = max(len(s) for s in sequences)
    batch = torch.zeros((len(sequences), longest), dtype=torch.int64)
    for i, s in enumerate(sequences):
        batch[i, : len(s)] = s
    logits = model(batch)[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(2, batch[:, 1:, None]).squeeze(2)
    out = []
    for i, s in enumerate(sequences):
        out.append(torch.cat([logp.new_zeros(1), logp[i, : len(s) - 1]]))
    return out


def sequence_logprobs_entropy(
    model: nn.Module, sequences: list[torch.Tensor], temperature: float = 1.0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`sequence_logprobs` and, per position, the entropy (nats) of the distribution the
    token was sampled from, at ``temperature`` (entry 0 of each is 0.0)."""
    if not sequences:
        return [], []
    longest = max(len(s) for s in sequences)
    batch = torch.zeros((len(sequences), longest), dtype=torch.int64)
    for i, s in enumerate(sequences):
        batch[i, : len(s)] = s
    logits = model(batch)[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(2, batch[:, 1:, None]).squeeze(2)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    lps, ents = [], []
    for i, s in enumerate(sequences):
        lps.append(torch.cat([logp.new_zeros(1), logp[i, : len(s) - 1]]))
        ents.append(torch.cat([entropy.new_zeros(1), entropy[i, : len(s) - 1]]))
    return lps, ents
