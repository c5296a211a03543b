"""Micro-batches become real torch tensors with the reference's dtypes and shapes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trio_rl.trainer import TensorConversionError, to_torch
from trio_rl.wire import MicroBatch, RoutedExperts, SamplingMask, decode, encode


def _mb(length: int = 3, **kw: object) -> MicroBatch:
    fields: dict[str, object] = {
        "input_ids": list(range(5, 5 + length)),
        "loss_mask": [i % 2 == 0 for i in range(length)],
        "advantages": [0.5] * length,
        "inference_logprobs": [-0.25] * length,
        "position_ids": list(range(length)),
        "sequence_lengths": [length],
        "temperatures": [1.0] * length,
        "env_names": ["env"] * length,
        "seq_lens": [length],
    }
    fields.update(kw)
    return MicroBatch(**fields)  # type: ignore[arg-type]


def test_dtypes_and_shapes() -> None:
    t = to_torch(
        _mb(
            3,
            ref_logprobs=[-1.0, -2.0, -3.0],
            mm_token_type_ids=[0, 1, 0],
            ce_weights=[1, 0.5, 0.0],
        )
    )
    assert t.input_ids.dtype == t.position_ids.dtype == t.mm_token_type_ids.dtype == torch.int64  # type: ignore[union-attr]
    assert t.input_ids.shape == t.loss_mask.shape == t.advantages.shape == (1, 3)
    assert t.loss_mask.dtype == torch.bool
    for stream in (
        t.advantages,
        t.inference_logprobs,
        t.temperatures,
        t.ref_logprobs,
        t.ce_weights,
    ):
        assert stream is not None
        assert stream.dtype == torch.float32
        assert stream.shape == (1, 3)
    assert t.seq_lens.dtype == torch.int64
    assert t.seq_lens.tolist() == [3]
    assert t.lora_num_tokens.tolist() == [3]
    assert t.input_ids.tolist() == [[5, 6, 7]]
    assert t.loss_mask.tolist() == [[True, False, True]]
    assert t.ce_weights.tolist() == [[1.0, 0.5, 0.0]]  # type: ignore[union-attr]
    assert t.rl_weights is None
    assert t.routed_experts is None
    assert t.sampling_mask_ids is None


@pytest.mark.parametrize("dtype", ["uint8", "int16", "int32", "int64", "uint16"])
def test_routed_experts_rebuilt_from_bytes(dtype: str) -> None:
    array = (np.arange(3 * 4 * 2) % 120).astype(dtype).reshape(3, 4, 2)
    mb = _mb(
        3,
        routed_experts=RoutedExperts(
            array.astype(np.dtype(dtype).newbyteorder("<")).tobytes(), [3, 4, 2], dtype
        ),
    )
    (wire_mb,) = decode(encode([mb]))  # as the trainer receives it
    t = to_torch(wire_mb)
    assert t.routed_experts is not None
    assert t.routed_experts.dtype == torch.int32
    assert t.routed_experts.shape == (3, 4, 2)
    assert np.array_equal(t.routed_experts.numpy(), array.astype(np.int32))


def test_sampling_mask_tensors() -> None:
    counts = np.array([2, 0, 1], dtype="<i4")
    ids = np.array([7, 9, 4], dtype="<i4")
    t = to_torch(_mb(3, sampling_mask=SamplingMask(ids=ids.tobytes(), counts=counts.tobytes())))
    assert t.sampling_mask_counts is not None
    assert t.sampling_mask_ids is not None
    assert t.sampling_mask_counts.tolist() == [2, 0, 1]
    assert t.sampling_mask_ids.tolist() == [7, 9, 4]
    assert t.sampling_mask_ids.dtype == torch.int32


@given(
    st.lists(st.integers(0, 2**31), min_size=1, max_size=30),
    st.lists(st.floats(-1e6, 1e6, width=32) | st.integers(-100, 100), min_size=1, max_size=30),
)
def test_values_survive_conversion(ids: list[int], values: list[float]) -> None:
    n = min(len(ids), len(values))
    mb = _mb(n, input_ids=ids[:n], advantages=values[:n], rl_weights=values[:n])
    t = to_torch(mb)
    assert t.input_ids.tolist() == [ids[:n]]
    assert t.advantages.tolist() == [[float(v) for v in values[:n]]]
    assert t.rl_weights is not None
    assert torch.equal(t.rl_weights, t.advantages)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"advantages": [0.0]}, "advantages"),
        ({"rl_weights": [1.0] * 4}, "rl_weights"),
        ({"routed_experts": RoutedExperts(b"\x00" * 5, [3, 1, 1], "int16")}, "routed_experts"),
        ({"routed_experts": RoutedExperts(b"\x00" * 3, [3], "object")}, "routed_experts"),
        ({"routed_experts": RoutedExperts(b"", [0], "no-such-dtype")}, "routed_experts"),
        ({"sampling_mask": SamplingMask(ids=b"", counts=bytes(8))}, "sampling_mask.counts"),
        (
            {"sampling_mask": SamplingMask(ids=b"", counts=b"\x01\x00\x00\x00" * 3)},
            "sampling_mask.ids",
        ),
    ],
)
def test_inconsistent_micro_batches_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(TensorConversionError) as info:
        to_torch(_mb(3, **kw))
    assert info.value.field == field
    assert repr(field) in str(info.value)


def test_trainer_imports_without_torch() -> None:
    # torch is an optional extra: importing the trainer facade must not import it.
    code = "import sys, trio_rl.trainer; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
