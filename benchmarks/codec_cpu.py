"""CPU codec throughput: nybble's quantize/dequantize against the numpy oracle, bitsandbytes
(when importable) and the memory-copy bandwidth, all measured in this one run.

    python benchmarks/codec_cpu.py [--shapes 4096x4096,14336x4096] [--repeat 7]

Prints one JSON object per measurement, then a summary of the ratios the targets in
docs/benchmarks.md ask for, and writes benchmarks/results/codec_cpu.json.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from _timing import emit, machine, median_seconds, write_results

import nybble
from nybble import _core, reference

BLOCKSIZE = 64


def bytes_dequantize(n: int, out_itemsize: int) -> int:
    return n // 2 + 4 * (n // BLOCKSIZE) + out_itemsize * n


def load_bnb() -> Any:
    try:
        import bitsandbytes.functional as bnbf
        import torch
    except Exception:
        return None
    return bnbf, torch


def run_shape(rows: int, cols: int, repeat: int, sink: list[dict[str, Any]]) -> dict[str, float]:
    n = rows * cols
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    shape = f"{rows}x{cols}"
    rate: dict[str, float] = {}

    def record(what: str, seconds: float, nbytes: int | None = None) -> None:
        rate[what] = n / seconds
        r = {"shape": shape, "what": what, "ms": seconds * 1e3, "melem_per_s": n / seconds / 1e6}
        if nbytes is not None:
            r["gb_per_s"] = nbytes / seconds / 1e9
        emit(r, sink)

    copy_s = median_seconds(lambda: x.copy(), repeat)
    record("copy f32 (numpy)", copy_s, 8 * n)
    q = nybble.quantize(x)
    record("nybble quantize f32", median_seconds(lambda: nybble.quantize(x), repeat))
    for dtype, size in (("float32", 4), ("bfloat16", 2), ("float16", 2)):
        s = median_seconds(lambda d=dtype: q.dequantize(d), repeat)
        record(f"nybble dequantize {dtype}", s, bytes_dequantize(n, size))
    # The same two into buffers written before: no page faults, which on a fresh output of
    # this size cost the kernel as much as the work (it zeroes every new page).
    out, dst = np.ones(n, np.float32), np.ones_like(x)
    record(
        "copy f32 into a written buffer",
        median_seconds(lambda: np.copyto(dst, x), repeat),
        8 * n,
    )
    record(
        "nybble dequantize float32 into a written buffer",
        median_seconds(
            lambda: _core.dequantize_into(q.codes, q.absmax, BLOCKSIZE, "nf4", out), repeat
        ),
        bytes_dequantize(n, 4),
    )
    flat = x.ravel()
    oracle_repeat = max(3, repeat // 2)
    record("oracle quantize", median_seconds(lambda: reference.quantize(flat), oracle_repeat, 1))
    record(
        "oracle dequantize",
        median_seconds(lambda: reference.dequantize(q.codes, q.absmax, n), oracle_repeat, 1),
    )
    bnb = load_bnb()
    if bnb is not None:
        bnbf, torch = bnb
        t = torch.from_numpy(x)
        packed, state = bnbf.quantize_4bit(t, blocksize=BLOCKSIZE, quant_type="nf4")
        record(
            "bitsandbytes quantize_4bit",
            median_seconds(
                lambda: bnbf.quantize_4bit(t, blocksize=BLOCKSIZE, quant_type="nf4"), repeat
            ),
        )
        record(
            "bitsandbytes dequantize_4bit",
            median_seconds(lambda: bnbf.dequantize_4bit(packed, state), repeat),
        )
    summary = {
        "dequantize_vs_oracle": rate["nybble dequantize float32"] / rate["oracle dequantize"],
        "quantize_vs_oracle": rate["nybble quantize f32"] / rate["oracle quantize"],
        # Bandwidth of the dequantize (bytes it moves) over that of copying its output.
        "dequantize_vs_copy_bandwidth": (bytes_dequantize(n, 4) * rate["nybble dequantize float32"])
        / (8 * n * rate["copy f32 (numpy)"]),
        "dequantize_vs_copy_bandwidth_written_buffers": (
            bytes_dequantize(n, 4) * rate["nybble dequantize float32 into a written buffer"]
        )
        / (8 * n * rate["copy f32 into a written buffer"]),
    }
    if bnb is not None:
        summary["dequantize_vs_bitsandbytes"] = (
            rate["nybble dequantize float32"] / rate["bitsandbytes dequantize_4bit"]
        )
        summary["quantize_vs_bitsandbytes"] = (
            rate["nybble quantize f32"] / rate["bitsandbytes quantize_4bit"]
        )
    emit({"shape": shape, "summary": summary}, sink)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x4096,14336x4096")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    sink: list[dict[str, Any]] = []
    summaries = {}
    for spec in args.shapes.split(","):
        rows, cols = (int(v) for v in spec.split("x"))
        summaries[spec] = run_shape(rows, cols, args.repeat, sink)
    targets = {
        "dequantize_vs_oracle": 10.0,
        "dequantize_vs_bitsandbytes": 4.0,
        "dequantize_vs_copy_bandwidth": 0.6,
        "dequantize_vs_copy_bandwidth_written_buffers": 0.6,
        "quantize_vs_oracle": 25.0,
        "quantize_vs_bitsandbytes": 20.0,
    }
    print(f"\n{'ratio':46s}" + "".join(f"{s:>16s}" for s in summaries) + f"{'target':>10s}")
    for key, target in targets.items():
        cells = "".join(
            f"{summaries[s][key]:16.2f}" if key in summaries[s] else f"{'n/a':>16s}"
            for s in summaries
        )
        print(f"{key:46s}{cells}{target:10.2f}")
    path = write_results(
        "codec_cpu",
        {
            "machine": machine(),
            "simd": _core.simd_level(),
            "measurements": sink,
            "summary": summaries,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
