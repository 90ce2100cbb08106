"""Times the tensor-core 4-bit GEMV over its compile-time parameters (warps per block, stages,
groups per stage) on this GPU: how the defaults in kernels/nf4.cu were chosen.

    python benchmarks/gemv_tune.py [--configs 8:4:16,8:3:32] [--old OLD.cu] [--double-quant]
                                   [--out-dir DIR]

Each configuration is compiled from the kernel source with -DTC_WARPS/-DTC_STAGES/
-DTC_STAGE_GROUPS (at least 3 stages: the nested kernel keeps two landed), launched with as
many blocks as the GPU holds (nybble.cuda._launch.tc_blocks), checked against the float32
product of the dequantized weight, and timed like gpu_codec.py (CUDA events behind a spin
kernel, weights rotated past the L2 cache). `--old` times the bf16 GEMV of another version of
the file too (its gemv_bf16_m* kernels with 8 rows per block of 128 threads, the layout before
the tensor-core GEMV), to compare before and after.
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

DEFAULT_CONFIGS = "8:3:16,8:4:16,4:3:16,4:4:16,4:3:32,8:5:16"


def compile_module(source_text: str | None, defines: list[str]) -> Any:
    module = cuda_function.Module()
    module.load(_module.compile_cubin(cp.cuda.Device().compute_capability, source_text, defines))
    return module


def tc_launcher(module: Any, config: tuple[int, int, int], x: Any, y: Any) -> Any:
    warps, stages, stage_groups = config
    smem, kernels = {}, {}
    for g in (32, 64):
        for dq in ("", "_dq"):
            smem[g, dq] = _launch.tc_shared_bytes(g, stages, stage_groups)
            kernels[g, dq] = module.get_function(f"gemv_tc_bf16_g{g}{dq}")
            _module.allow_dynamic_shared(kernels[g, dq], smem[g, dq])

    def launch(q: nybble.NF4Tensor) -> None:
        rows, cols = q.shape
        g = 64 if cols % 64 == 0 and q.blocksize >= 64 else 32
        log2_bs = _launch._log2_blocksize(q.blocksize)
        table = _launch.table("values", "nf4")
        absmax = None if q.nested is not None else q.absmax
        scales = _launch._scale_args(absmax, q.nested, -(-rows * cols // q.blocksize))
        args = (x, q.codes, *scales, table, np.int32(rows), np.int32(cols), np.int32(x.shape[0]),
                log2_bs, y)  # fmt: skip
        dq = "" if q.nested is None else "_dq"
        tiles = -(-rows // _launch.TC_ROWS)
        grid = (min(tiles, _module.resident_blocks(kernels[g, dq], 32 * warps, smem[g, dq])),)
        kernels[g, dq](grid, (32 * warps,), args, shared_mem=smem[g, dq])

    return launch


def old_launcher(module: Any, x: Any, y: Any) -> Any:
    kernel = module.get_function(f"gemv_bf16_m{x.shape[0]}")

    def launch(q: nybble.NF4Tensor) -> None:
        rows, cols = q.shape
        scales = _launch._scale_args(q.absmax, None, rows * cols // q.blocksize)
        args = (x, q.codes, *scales, _launch.table("values", "nf4"), np.int32(rows),
                np.int32(cols), _launch._log2_blocksize(q.blocksize), y)  # fmt: skip
        kernel((-(-rows // 8),), (128,), args)

    return launch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="warps:stages:groups,...")
    parser.add_argument("--old", type=Path, help="an earlier kernels/nf4.cu to time as well")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--double-quant", action="store_true", help="time the nested kernels")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    variants = []
    for w, st, sg in configs:
        defines = [f"TC_WARPS={w}", f"TC_STAGES={st}", f"TC_STAGE_GROUPS={sg}"]
        name = f"warps={w} stages={st} groups={sg}"
        variants.append((name, compile_module(None, defines), (w, st, sg)))
    old = compile_module(args.old.read_text(), []) if args.old else None

    bench = Bench(args.repeat)
    bench.copy_bandwidth()
    records: list[dict[str, Any]] = []
    for rows, cols in SHAPES:
        w = host_bf16((rows, cols), 2)
        q = nybble.quantize(w, double_quant=args.double_quant)
        k = copies(codes_bytes(rows * cols, args.double_quant))
        qs = [q] + [clone_q(q) for _ in range(k - 1)]
        dense = cuda.dequantize(q, "float32")
        for m in (1, 4, 8):
            x = host_bf16((m, cols), 3)
            y = cp.empty((m, rows), x.dtype)
            want = x.astype(cp.float32) @ dense.T
            nbytes = codes_bytes(rows * cols, args.double_quant) + 2 * m * (cols + rows)
            runs = [(name, tc_launcher(module, cfg, x, y)) for name, module, cfg in variants]
            if old is not None and m <= 4 and not args.double_quant:
                runs.insert(0, ("old kernel (CUDA cores)", old_launcher(old, x, y)))
            for name, launch in runs:
                y.fill(0)
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
    name = "gemv_tune_dq.json" if args.double_quant else "gemv_tune.json"
    (args.out_dir / name).write_text(
        json.dumps({"copy_gb_per_s": bench.copy_gbs, "records": records}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
