"""Conversion of a micro-batch into the torch tensors a trainer consumes (docs/wire.md).

torch is an optional dependency: it is imported when :func:`to_torch` is first called, so
``import trio_rl.trainer`` works without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from ..errors import TensorConversionError
from ..wire import MicroBatch

if TYPE_CHECKING:
    import torch

__all__ = ["TensorConversionError", "TrainerTensors", "to_torch"]

_NUMERIC_KINDS = "biuf"


@attrs.frozen
class TrainerTensors:
    """One micro-batch as tensors. ``T`` is the token count, ``n`` the number of sequences.

    Token streams are ``[1, T]``: ids, positions and mm token types int64; advantages,
    logprobs, temperatures, reference logprobs and loss weights float32; the loss mask bool.
    Optional streams absent from the micro-batch are ``None``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    temperatures: torch.Tensor
    seq_lens: torch.Tensor
    """int64 ``[n]``."""
    lora_num_tokens: torch.Tensor
    """int32 ``[1]`` holding ``T`` (one adapter covers the whole micro-batch)."""
    ref_logprobs: torch.Tensor | None = None
    mm_token_type_ids: torch.Tensor | None = None
    rl_weights: torch.Tensor | None = None
    ce_weights: torch.Tensor | None = None
    ref_kl_weights: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    """int32, the shape carried on the wire (``[T, layers, topk]``)."""
    sampling_mask_ids: torch.Tensor | None = None
    """int32 ``[sum(counts)]``: the allowed token ids of every position, concatenated."""
    sampling_mask_counts: torch.Tensor | None = None
    """int32 ``[T]``: how many ids each position allows (0 = unrestricted)."""
    payload: dict[str, torch.Tensor] = attrs.field(factory=dict)
    """By-handle payload fields read from their files, by field name (empty when none were
    read; see `trio_rl.trainer.read_payload_arrays` for the shapes)."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("trio_rl.trainer.to_torch needs torch: install trio-rl[torch]") from exc
    return torch


def _raw_array(field: str, data: Any, dtype_name: str, shape: list[int]) -> np.ndarray[Any, Any]:
    """A read-only numpy view of little-endian wire bytes (no copy)."""
    try:
        dtype = np.dtype(dtype_name)
    except TypeError as exc:
        raise TensorConversionError(field, f"unknown dtype {dtype_name!r}") from exc
    if dtype.kind not in _NUMERIC_KINDS:
        raise TensorConversionError(field, f"dtype {dtype_name!r} is not numeric")
    if any(d < 0 for d in shape):
        raise TensorConversionError(field, f"negative dimension in shape {shape}")
    expected = math.prod(shape) * dtype.itemsize
    if len(memoryview(data).cast("B")) != expected:
        raise TensorConversionError(
            field,
            f"{len(memoryview(data).cast('B'))} bytes do not hold shape {shape} of {dtype_name}",
        )
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(shape)


def to_torch(
    mb: MicroBatch, payload: Mapping[str, np.ndarray[Any, Any]] | None = None
) -> TrainerTensors:
    """Convert ``mb`` into tensors (see :class:`TrainerTensors`).

    ``payload`` holds the micro-batch's by-handle fields already read from their files
    (`trio_rl.trainer.read_payload_arrays`); they become ``TrainerTensors.payload``.

    Raw byte arrays are viewed in place with numpy and converted in one pass (never copied
    byte by byte). Raises :class:`TensorConversionError` when a stream's length differs from
    the token count or raw bytes do not match their dtype and shape. Synchronous CPU work.

    torch is imported on the first call (it is an optional extra); that import takes seconds,
    so a trio trainer should ``import torch`` before ``trio.run`` rather than inside the loop.
    """
    torch = _torch()
    length = len(mb.input_ids)

    def row(field: str, values: list[Any] | None, dtype: Any) -> Any:
        if values is None:
            return None
        if len(values) != length:
            raise TensorConversionError(field, f"{len(values)} values for {length} tokens")
        return torch.tensor(values, dtype=dtype).reshape(1, length)

    int64, float32 = torch.int64, torch.float32
    routed = None
    if mb.routed_experts is not None:
        re = mb.routed_experts
        view = _raw_array("routed_experts", re.data, re.dtype, list(re.shape))
        routed = torch.empty(tuple(re.shape), dtype=torch.int32)
        routed.numpy()[...] = view  # one converting pass from the wire bytes
    mask_ids = mask_counts = None
    if mb.sampling_mask is not None:
        sm = mb.sampling_mask
        counts = _raw_array("sampling_mask.counts", sm.counts, "int32", [len(sm.counts) // 4])
        if counts.shape[0] != length:
            raise TensorConversionError(
                "sampling_mask.counts", f"{counts.shape[0]} counts for {length} tokens"
            )
        total = int(counts.sum())
        ids = _raw_array("sampling_mask.ids", sm.ids, "int32", [total])
        mask_counts = torch.from_numpy(counts.astype(np.int32))
        mask_ids = torch.from_numpy(ids.astype(np.int32))
    return TrainerTensors(
        input_ids=row("input_ids", mb.input_ids, int64),
        position_ids=row("position_ids", mb.position_ids, int64),
        loss_mask=row("loss_mask", mb.loss_mask, torch.bool),
        advantages=row("advantages", mb.advantages, float32),
        inference_logprobs=row("inference_logprobs", mb.inference_logprobs, float32),
        temperatures=row("temperatures", mb.temperatures, float32),
        seq_lens=torch.tensor(mb.seq_lens, dtype=int64),
        lora_num_tokens=torch.tensor([length], dtype=torch.int32),
        ref_logprobs=row("ref_logprobs", mb.ref_logprobs, float32),
        mm_token_type_ids=row("mm_token_type_ids", mb.mm_token_type_ids, int64),
        rl_weights=row("rl_weights", mb.rl_weights, float32),
        ce_weights=row("ce_weights", mb.ce_weights, float32),
        ref_kl_weights=row("ref_kl_weights", mb.ref_kl_weights, float32),
        routed_experts=routed,
        sampling_mask_ids=mask_ids,
        sampling_mask_counts=mask_counts,
        payload={
            name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in (payload or {}).items()
        },
    )
