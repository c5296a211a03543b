"""Encoder memory and codec throughput, side by side with the reference's encoders.

Peak traced allocation (tracemalloc, inputs preallocated and excluded, the maximum over
trials) of encoding ~64 MiB of synthetic binary payload (routed-expert bytes, as in the
reference measurement of prime-rl #3811), as one 64 MiB, sixteen 4 MiB and 63 + 1 MiB
micro-batches:

- ``encode``            trio_rl.wire.encode (returns bytes)
- ``encode_into file``  trio_rl.wire.encode_into an open file
- ``msgspec whole``     msgspec's encoder on the whole list (the wire reference)
- ``#3821 join``        header + each item's msgspec encoding, b"".join (reference "before")
- ``#3811 BytesIO``     header + each item's msgspec encoding into BytesIO (reference "after")

and the figures the reference quoted. Then encode/decode throughput for a binary-dominated and
a list-dominated payload. msgspec columns need msgspec (a test dependency).

    python benchmarks/bench_encode.py [--trials 3] [--list-mib 16]
"""

import argparse
import gc
import io
import os
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

from trio_rl.wire import MicroBatch, RoutedExperts, decode, encode, encode_into

try:
    import msgspec
except ImportError:  # the msgspec columns are skipped
    msgspec = None

MiB = 1 << 20
REFERENCE_BEFORE = {"one 64 MiB": 160.0, "sixteen 4 MiB": 160.0, "63 + 1 MiB": 160.0}
REFERENCE_AFTER = {"one 64 MiB": 96.0, "sixteen 4 MiB": 73.5, "63 + 1 MiB": 157.5}


def micro_batch(payload_bytes: int, tokens: int = 16) -> MicroBatch:
    return MicroBatch(
        input_ids=list(range(tokens)),
        loss_mask=[True] * tokens,
        advantages=[0.5] * tokens,
        inference_logprobs=[-0.1] * tokens,
        position_ids=list(range(tokens)),
        sequence_lengths=[tokens],
        temperatures=[1.0] * tokens,
        env_names=["env"] * tokens,
        seq_lens=[tokens],
        routed_experts=RoutedExperts(
            data=os.urandom(payload_bytes), shape=[payload_bytes], dtype="uint8"
        ),
    )


def list_micro_batch(tokens: int) -> MicroBatch:
    floats = [i * 0.001 - 3.0 for i in range(tokens)]
    return MicroBatch(
        input_ids=list(range(1000, 1000 + tokens)),
        loss_mask=[i % 3 != 0 for i in range(tokens)],
        advantages=floats,
        inference_logprobs=floats[::-1],
        position_ids=list(range(tokens)),
        sequence_lengths=[tokens],
        temperatures=[1.0] * tokens,
        env_names=["env"] * tokens,
        seq_lens=[tokens],
        ref_logprobs=floats,
    )


# --- the reference's encoders, rebuilt on msgspec for comparison ---------------------------


def _to_msgspec_types() -> tuple[Any, Any]:
    assert msgspec is not None

    class RefRoutedExperts(msgspec.Struct, array_like=True, gc=False):
        data: bytes
        shape: list[int]
        dtype: str

    class RefMicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
        input_ids: list[int]
        loss_mask: list[bool]
        advantages: list[float]
        inference_logprobs: list[float]
        position_ids: list[int]
        sequence_lengths: list[int]
        temperatures: list[float]
        env_names: list[str]
        seq_lens: list[int]
        ref_logprobs: list[float] | None = None
        routed_experts: RefRoutedExperts | None = None
        mm_refs: None = None
        mm_token_type_ids: None = None
        rl_weights: None = None
        ce_weights: None = None
        ref_kl_weights: None = None
        sampling_mask: None = None
        trace_ids: None = None
        branch_indices: None = None
        payload: None = None

    return RefMicroBatch, RefRoutedExperts


def to_ref(mbs: Sequence[MicroBatch]) -> list[Any]:
    ref_mb, ref_re = _to_msgspec_types()
    out = []
    for mb in mbs:
        re = mb.routed_experts
        out.append(
            ref_mb(
                mb.input_ids,
                mb.loss_mask,
                mb.advantages,
                mb.inference_logprobs,
                mb.position_ids,
                mb.sequence_lengths,
                mb.temperatures,
                mb.env_names,
                mb.seq_lens,
                mb.ref_logprobs,
                None if re is None else ref_re(re.data, re.shape, re.dtype),
            )
        )
    return out


def _header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def msgspec_whole(items: list[Any]) -> bytes:
    return msgspec.msgpack.Encoder().encode(items)  # type: ignore[union-attr]


def join_3821(items: list[Any]) -> bytes:
    enc = msgspec.msgpack.Encoder()  # type: ignore[union-attr]
    return b"".join([_header(len(items)), *(enc.encode(x) for x in items)])


def bytesio_3811(items: list[Any]) -> bytes:
    enc = msgspec.msgpack.Encoder()  # type: ignore[union-attr]
    if len(items) < 2:
        return enc.encode(items)
    buf = io.BytesIO()
    buf.write(_header(len(items)))
    for x in items:
        buf.write(enc.encode(x))
    return buf.getvalue()


# --- measurement ---------------------------------------------------------------------------


def peak_mib(fn: Callable[[], object], trials: int) -> float:
    worst = 0
    for _ in range(trials):
        gc.collect()
        tracemalloc.start()
        try:
            result = fn()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del result
        worst = max(worst, peak)
    return worst / MiB


def best_seconds(fn: Callable[[], object], trials: int) -> float:
    """Best CPU time (user + system) of ``fn``: robust on a machine shared with other jobs."""
    best = float("inf")
    for _ in range(trials):
        gc.collect()
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def memory_row(name: str, sizes: list[int], trials: int, path: str) -> list[float]:
    mbs = [micro_batch(size) for size in sizes]
    expected = encode(mbs)

    def into_file() -> int:
        with open(path, "wb") as f:
            return encode_into(mbs, f)

    row = [peak_mib(lambda: encode(mbs), trials), peak_mib(into_file, trials)]
    with open(path, "rb") as f:
        assert f.read() == expected, "encode_into differs from encode"
    if msgspec is not None:
        ref = to_ref(mbs)
        assert msgspec_whole(ref) == expected, "not byte-identical to the reference"
        row.append(peak_mib(lambda: msgspec_whole(ref), trials))
        row.append(peak_mib(lambda: join_3821(ref), trials))
        row.append(peak_mib(lambda: bytesio_3811(ref), trials))
    return [*row, REFERENCE_BEFORE[name], REFERENCE_AFTER[name]]


def throughput_row(mbs: list[MicroBatch], trials: int, path: str) -> tuple[list[float], float]:
    data = encode(mbs)
    size = len(data) / MiB

    def into_file() -> int:
        with open(path, "wb") as f:
            return encode_into(mbs, f)

    row = [
        size,
        size / best_seconds(lambda: encode(mbs), trials),
        size / best_seconds(into_file, trials),
        size / best_seconds(lambda: decode(data), trials),
    ]
    if msgspec is not None:
        ref = to_ref(mbs)
        enc = msgspec.msgpack.Encoder()
        dec = msgspec.msgpack.Decoder(list[type(ref[0])])  # type: ignore[misc]
        row.append(size / best_seconds(lambda: enc.encode(ref), trials))
        row.append(size / best_seconds(lambda: dec.decode(data), trials))
    return row, peak_mib(lambda: encode(mbs), 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--list-mib", type=int, default=16, help="list-dominated payload size")
    args = parser.parse_args()

    cases = {
        "one 64 MiB": [64 * MiB],
        "sixteen 4 MiB": [4 * MiB] * 16,
        "63 + 1 MiB": [63 * MiB, 1 * MiB],
    }
    print(f"Peak traced allocation, MiB (max over {args.trials} trials; inputs excluded)")
    columns = ["encode", "encode_into file"]
    if msgspec is not None:
        columns += ["msgspec whole", "#3821 join", "#3811 BytesIO"]
    columns += ["ref before", "ref after"]
    print(f"{'case':<15}" + "".join(f"{c:>18}" for c in columns))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank_0.bin")
        for name, sizes in cases.items():
            row = memory_row(name, sizes, args.trials, path)
            print(f"{name:<15}" + "".join(f"{v:>18.1f}" for v in row))

        print()
        print(f"Throughput (best of {args.trials}), MiB of encoded payload per CPU second")
        tokens = args.list_mib * MiB // 47  # ~47 encoded bytes per token over the 9 streams
        head = ["size MiB", "encode", "encode_into", "decode"]
        if msgspec is not None:
            head += ["msgspec enc", "msgspec dec"]
        print(f"{'payload':<20}" + "".join(f"{c:>14}" for c in head))
        payloads = {
            "binary 64 MiB x1": lambda: [micro_batch(64 * MiB)],
            f"lists ~{args.list_mib} MiB x4": lambda: [
                list_micro_batch(tokens // 4) for _ in range(4)
            ],
        }
        for name, build in payloads.items():
            row, peak = throughput_row(build(), args.trials, path)
            print(f"{name:<20}" + "".join(f"{v:>14.1f}" for v in row))
            print(f"{'':<20}  encode peak {peak:.1f} MiB for {row[0]:.1f} MiB of payload")


if __name__ == "__main__":
    main()
