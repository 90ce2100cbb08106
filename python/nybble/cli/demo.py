"""`nybble demo`: quantize a built-in sample weight and report error, size and speed."""

from __future__ import annotations

import argparse
import time

import numpy as np

from .. import _core, quantize
from ._common import format_table, print_json

#: The sample: a seeded N(0, 0.02) weight of a Qwen3-4B attention projection.
SAMPLE_SHAPE = (2560, 2560)
SAMPLE_SEED = 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="quantize a built-in sample weight; print error and size")
    p.add_argument("--codebook", default="nf4", choices=["nf4", "fp4", "int8"])
    p.add_argument("--blocksize", type=int, default=64)
    p.add_argument("--double-quant", action="store_true")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(SAMPLE_SEED)
    w = (rng.standard_normal(SAMPLE_SHAPE) * 0.02).astype(np.float32)
    t0 = time.perf_counter()
    q = quantize(
        w, blocksize=args.blocksize, double_quant=args.double_quant, codebook=args.codebook
    )
    t1 = time.perf_counter()
    back = q.dequantize("float32")
    t2 = time.perf_counter()
    err = np.abs(back - w)
    scale = np.repeat(q.absmax, q.blocksize)[: w.size].reshape(w.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
        normalised = np.where(scale > 0, err / scale, 0.0)
    report = {
        "shape": list(w.shape),
        "codebook": q.codebook,
        "blocksize": q.blocksize,
        "double_quant": q.double_quant,
        "simd": _core.simd_level(),
        "mean_abs_error": float(err.mean()),
        "max_abs_error": float(err.max()),
        "max_error_over_absmax": float(normalised.max()),
        "bytes_f32": int(w.nbytes),
        "bytes_quantized": q.nbytes,
        "compression_vs_f32": w.nbytes / q.nbytes,
        "bits_per_parameter": 8 * q.nbytes / w.size,
        "quantize_melem_per_s": w.size / (t1 - t0) / 1e6,
        "dequantize_melem_per_s": w.size / (t2 - t1) / 1e6,
    }
    if args.json:
        print_json(report)
        return 0
    rows = [[k, f"{v:.6g}" if isinstance(v, float) else str(v)] for k, v in report.items()]
    print(format_table(["figure", "value"], rows))
    return 0
