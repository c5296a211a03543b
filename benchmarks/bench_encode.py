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
a list-dominated payload, for trio-rl's codec with msgspec as its accelerator (the default when
msgspec is installed), on msgpack alone (the baseline), and for msgspec itself (the reference's
typed encoder and decoder). Repetitions are interleaved; each figure is the median and the
spread (min-max) over them. msgspec columns need msgspec (a test dependency).

    python benchmarks/bench_encode.py [--trials 3] [--list-mib 16]
"""

import argparse
import gc
import io
import os
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

from trio_rl.wire import MicroBatch, RoutedExperts, _accel, decode, encode, encode_into

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


def cpu_seconds(fn: Callable[[], object]) -> float:
    """CPU time (user + system) of one call: robust on a machine shared with other jobs."""
    gc.collect()
    start = time.process_time()
    fn()
    return time.process_time() - start


def baseline(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with trio-rl's codec on msgpack alone (the msgspec accelerator off)."""

    def run() -> object:
        enabled = _accel.ENABLED
        _accel.ENABLED = False
        try:
            return fn()
        finally:
            _accel.ENABLED = enabled

    return run


def interleaved(fns: dict[str, Callable[[], object]], trials: int) -> dict[str, list[float]]:
    """CPU seconds of each function over ``trials`` rounds, one call of each per round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(trials):
        for name, fn in fns.items():
            times[name].append(cpu_seconds(fn))
    return times


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


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


def throughput(
    mbs: list[MicroBatch], trials: int, path: str
) -> tuple[float, dict[str, list[float]], dict[str, float]]:
    """Encoded size (MiB), MiB per CPU second of each codec, and encode peaks (MiB)."""
    data = encode(mbs)
    assert baseline(lambda: encode(mbs))() == data, "the backends disagree"
    size = len(data) / MiB

    def into_file() -> int:
        with open(path, "wb") as f:
            return encode_into(mbs, f)

    fns: dict[str, Callable[[], object]] = {"encode": lambda: encode(mbs)}
    if msgspec is not None:
        ref = to_ref(mbs)
        assert msgspec_whole(ref) == data, "not byte-identical to the reference"
        enc = msgspec.msgpack.Encoder()
        dec = msgspec.msgpack.Decoder(list[type(ref[0])])  # type: ignore[misc]
        fns["msgspec enc"] = lambda: enc.encode(ref)
    fns["encode_into"] = into_file
    fns["encode msgpack"] = baseline(lambda: encode(mbs))
    fns["decode"] = lambda: decode(data)
    if msgspec is not None:
        fns["msgspec dec"] = lambda: dec.decode(data)
    fns["decode msgpack"] = baseline(lambda: decode(data))
    rates = {name: [size / t for t in ts] for name, ts in interleaved(fns, trials).items()}
    peaks = {
        "encode": peak_mib(lambda: encode(mbs), 1),
        "encode msgpack": peak_mib(baseline(lambda: encode(mbs)), 1),
    }
    if msgspec is not None:
        peaks["msgspec"] = peak_mib(lambda: enc.encode(ref), 1)
    return size, rates, peaks


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
            if name == "one 64 MiB":
                print(
                    f"goal 5: binary payload encode peak {row[0]:.1f} MiB for 64 MiB "
                    f"({row[0] / 64:.2f}x; kept at <= 1.02x: "
                    f"{'reached' if row[0] / 64 <= 1.025 else 'not reached'})"
                )

        print()
        print(
            f"Throughput, MiB of encoded payload per CPU second: median [min-max] over "
            f"{args.trials} interleaved repetitions ('msgpack': trio-rl's codec without the "
            f"msgspec accelerator{'' if _accel.ENABLED else '; accelerator disabled'})"
        )
        tokens = args.list_mib * MiB // 47  # ~47 encoded bytes per token over the 9 streams
        payloads = {
            "binary 64 MiB x1": lambda: [micro_batch(64 * MiB)],
            f"lists ~{args.list_mib} MiB x4": lambda: [
                list_micro_batch(tokens // 4) for _ in range(4)
            ],
        }
        for name, build in payloads.items():
            size, rates, peaks = throughput(build(), args.trials, path)
            print(f"{name} ({size:.1f} MiB):")
            for codec, values in rates.items():
                print(f"  {codec:<16}{summary(values):>22}")
            if msgspec is not None:
                for op in ("enc", "dec"):
                    ours = statistics.median(rates[f"{op}ode"])
                    ref = statistics.median(rates[f"msgspec {op}"])
                    print(f"  {op}ode / msgspec {op}: {ours / ref:.2f}x (medians)")
                    if name.startswith("lists"):
                        print(
                            f"goal 5: list-heavy {op}ode {ours:.0f} against msgspec {ref:.0f} "
                            f"MiB/s ({ours / ref:.2f}x, medians of {args.trials}; goal >= 1.0x: "
                            f"{'reached' if ours >= ref else 'not reached'}), byte-identical "
                            "to msgspec (checked)"
                        )
            print(
                "  encode peak MiB: "
                + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items())
                + f" (for {size:.1f} MiB of payload)"
            )


if __name__ == "__main__":
    main()
