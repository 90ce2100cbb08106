"""Times the tensor-core 4-bit GEMV over its compile-time parameters (warps per block, stages,
groups per stage) on this GPU: how the defaults in kernels/nf4.cu were chosen.

    python benchmarks/gemv_tune.py [--configs 8:4:16,8:3:32] [--double-quant] [--out-dir DIR]

Each configuration is a build of the library's kernels with -DTC_WARPS/-DTC_STAGES/
-DTC_STAGE_GROUPS (at least 3 stages: the nested kernel keeps two landed), launched through
the library's own launcher (nybble.backends.cuda.launch.GemvWeight, given that build: its
grid and shared memory come from the build's launch facts), checked against the float32
product of the dequantized weight, and timed like gpu_codec.py (CUDA events behind a spin
kernel, weights rotated past the L2 cache).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import cupy as cp
from _timing import RESULTS, emit
from gpu_codec import (
    SHAPES,
    Bench,
    clone_q,
    codes_bytes,
    copies,
    gemv_weight,
    gpu_median,
    host_bf16,
)

import nybble
from nybble.backends.cuda import kernels

DEFAULT_CONFIGS = "8:3:16,8:4:16,4:3:16,4:4:16,4:3:32,8:5:16"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="warps:stages:groups,...")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--double-quant", action="store_true", help="time the nested kernels")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    variants = []
    for w, st, sg in configs:
        defines = (f"TC_WARPS={w}", f"TC_STAGES={st}", f"TC_STAGE_GROUPS={sg}")
        variants.append((f"warps={w} stages={st} groups={sg}", kernels.module(defines)))

    bench = Bench(args.repeat)
    bench.copy_bandwidth()
    records: list[dict[str, Any]] = []
    for rows, cols in SHAPES:
        w = host_bf16((rows, cols), 2)
        q = nybble.quantize(w, double_quant=args.double_quant)
        k = copies(codes_bytes(rows * cols, args.double_quant))
        qs = [q] + [clone_q(q) for _ in range(k - 1)]
        dense = q.dequantize("float32")
        for m in (1, 4, 8):
            x = host_bf16((m, cols), 3)
            y = cp.empty((m, rows), x.dtype)
            want = x.astype(cp.float32) @ dense.T
            nbytes = codes_bytes(rows * cols, args.double_quant) + 2 * m * (cols + rows)
            for name, module in variants:
                weights = [gemv_weight(qi, module) for qi in qs]
                y.fill(0)
                weights[0](x, y)
                err = float(cp.abs(y.astype(cp.float32) - want).max() / cp.abs(want).max())
                seconds = gpu_median(
                    lambda i, ws=weights, x=x, y=y: ws[i % len(ws)](x, y), args.repeat
                )
                record = {
                    "variant": name,
                    "shape": f"{rows}x{cols}",
                    "tokens": m,
                    "us": round(seconds * 1e6, 2),
                    "pct_of_copy": round(100 * nbytes / seconds / 1e9 / bench.copy_gbs, 1),
                    "max_rel_err": float(f"{err:.2e}"),
                }
                emit(record, records)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "gemv_tune_dq.json" if args.double_quant else "gemv_tune.json"
    (args.out_dir / name).write_text(
        json.dumps({"copy_gb_per_s": bench.copy_gbs, "records": records}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
