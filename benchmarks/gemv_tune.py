"""Times the fused 4-bit GEMV over its compile-time parameters (threads per block, rows per
block, chunks in flight per thread) on this GPU: how the defaults in kernels/nf4.cu were chosen.

    python benchmarks/gemv_tune.py [--configs 128:4:2,256:1:4] [--source OLD.cu] [--out-dir DIR]

Each configuration is compiled from the kernel source with -DGEMV_THREADS/-DGEMV_ROWS/
-DGEMV_UNROLL, checked against cuBLAS on the dequantized weight, and timed like
gpu_codec.py (CUDA events behind a spin kernel, weights rotated past the L2 cache). `--source`
times another version of the file too (its own #defines win), to compare before and after.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np
from _timing import RESULTS, emit
from cupy.cuda import function as cuda_function
from gpu_codec import SHAPES, Bench, clone_q, codes_bytes, copies, gpu_median, host_bf16

import nybble
from nybble import cuda
from nybble.cuda import _launch, _module

DEFAULT_CONFIGS = "128:4:2,128:2:2,128:2:4,128:1:4,256:1:4,256:2:2,64:4:2,128:4:1,128:1:2"


def compile_module(source_text: str | None, config: tuple[int, int, int]) -> Any:
    threads, rows, unroll = config
    defines = [f"GEMV_THREADS={threads}", f"GEMV_ROWS={rows}", f"GEMV_UNROLL={unroll}"]
    module = cuda_function.Module()
    module.load(_module.compile_cubin(cp.cuda.Device().compute_capability, source_text, defines))
    return module


def launcher(module: Any, config: tuple[int, int, int], rows_per_block: int, x: Any, y: Any) -> Any:
    threads = config[0]
    kernel = module.get_function(f"gemv_bf16_m{x.shape[0]}")

    def launch(q: nybble.NF4Tensor) -> None:
        rows, cols = q.shape
        scales = _launch._scale_args(q.absmax, None, rows * cols // q.blocksize)
        args = (x, q.codes, *scales, _launch.table("values", "nf4"), np.int32(rows),
                np.int32(cols), _launch._log2_blocksize(q.blocksize), y)  # fmt: skip
        grid = -(-rows // rows_per_block)
        kernel((grid,), (threads,), args)

    return launch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="threads:rows:unroll,...")
    parser.add_argument("--source", type=Path, help="another kernels/nf4.cu to time as well")
    parser.add_argument(
        "--source-rows", type=int, default=16, help="rows per block of --source's GEMV"
    )
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    variants: list[tuple[str, str | None, tuple[int, int, int], int]] = [
        (f"threads={t} rows={r} unroll={u}", None, (t, r, u), r) for t, r, u in configs
    ]
    if args.source is not None:
        text = args.source.read_text()
        other = (f"{args.source.name} (its defaults)", text, (128, 4, 2), args.source_rows)
        variants.insert(0, other)
    modules = [(name, compile_module(t, c), c, rows) for name, t, c, rows in variants]

    bench = Bench(args.repeat)
    bench.copy_bandwidth()
    records: list[dict[str, Any]] = []
    for rows, cols in SHAPES:
        w = host_bf16((rows, cols), 2)
        q = nybble.quantize(w)
        k = copies(codes_bytes(rows * cols))
        qs = [q] + [clone_q(q) for _ in range(k - 1)]
        dense = cuda.dequantize(q, "float32")
        for m in (1, 4):
            x = host_bf16((m, cols), 3)
            y = cp.empty((m, rows), x.dtype)
            want = x.astype(cp.float32) @ dense.T
            nbytes = codes_bytes(rows * cols) + 2 * m * (cols + rows)
            for name, module, config, rows_per_block in modules:
                launch = launcher(module, config, rows_per_block, x, y)
                launch(q)
                err = float(cp.abs(y.astype(cp.float32) - want).max() / cp.abs(want).max())
                seconds = gpu_median(
                    lambda i, launch=launch, qs=qs, k=k: launch(qs[i % k]), args.repeat
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
    (args.out_dir / "gemv_tune.json").write_text(
        json.dumps({"copy_gb_per_s": bench.copy_gbs, "records": records}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
