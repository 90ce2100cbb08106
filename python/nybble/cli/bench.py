"""`nybble bench`: how fast the codec runs on this machine, against the obvious numpy
version of the same work, measured in one run (the benchmarks/ scripts go further)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _core, backends, formats, quantize
from ._common import CliError, format_table, print_json

_EPILOG = """\
examples:
  nybble bench                         # a 4096 x 4096 float32 weight on the CPU
  nybble bench --shape 14336x4096 --device cuda --json
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench",
        help="time quantize / dequantize on this machine against plain numpy",
        description="Times nybble's quantize and dequantize of a random weight (median of "
        "--repeat runs after a warm-up) and, on the CPU, the obvious numpy statement of the "
        "same work, in one run. Figures are elements per second and the ratio to numpy.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shape", default="4096x4096", help="ROWSxCOLS (default: 4096x4096)")
    p.add_argument("--codebook", default="nf4", choices=list(formats.CODEBOOKS))
    p.add_argument("--blocksize", type=int, default=64, help="default: 64")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default: cpu")
    p.add_argument("--repeat", type=int, default=5, help="timed runs (default: 5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _shape(text: str) -> tuple[int, int]:
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise CliError(f"--shape must be ROWSxCOLS, got {text!r}") from None
    if not (0 < rows <= 1 << 20 and 0 < cols <= 1 << 20 and rows * cols <= 1 << 31):
        raise CliError(f"--shape {text}: rows and columns from 1 to 2^20, at most 2^31 values")
    return rows, cols


def _median(fn: Callable[[], Any], repeat: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _numpy_quantize(x: np.ndarray, blocksize: int, codebook: str) -> None:
    """The obvious numpy statement: absmax per block, normalise, search the thresholds."""
    blocks = x.reshape(-1, blocksize)
    absmax = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = blocks * (np.float32(1) / absmax)
    if codebook == "int8":
        np.rint(v * 127)
    else:
        np.searchsorted(formats.thresholds(formats.check_codebook(codebook)), v)


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise CliError(f"--repeat must be >= 1, got {args.repeat}")
    rows, cols = _shape(args.shape)
    blocksize = formats.check_blocksize(args.blocksize)
    if (rows * cols) % blocksize:
        raise CliError(f"--shape {args.shape}: the element count must fill whole blocks")
    backend = backends.get(args.device)
    host = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    x = backend.from_host(host)
    sync = backend.synchronize
    q = quantize(x, blocksize, codebook=args.codebook)
    out = backend.xp.empty((rows, cols), np.float32)
    n = rows * cols
    timings = {
        "quantize": _median(
            lambda: quantize(x, blocksize, codebook=args.codebook), args.repeat, sync
        ),
        "dequantize -> float32": _median(lambda: q.dequantize("float32", out), args.repeat, sync),
    }
    reference: dict[str, float] = {}
    if args.device == "cpu":
        values = formats.values(args.codebook)
        codes = np.zeros(n, np.uint8)
        scales = np.ones((n // blocksize, 1), np.float32)
        reference = {
            "quantize": _median(
                lambda: _numpy_quantize(host, blocksize, args.codebook), args.repeat, sync
            ),
            "dequantize -> float32": _median(
                lambda: values[codes].reshape(-1, blocksize) * scales, args.repeat, sync
            ),
        }
    rows_out: list[dict[str, Any]] = []
    for what, seconds in timings.items():
        row: dict[str, Any] = {"what": what, "melem_per_s": round(n / seconds / 1e6, 1)}
        if what in reference:
            row["numpy_melem_per_s"] = round(n / reference[what] / 1e6, 1)
            row["speedup_vs_numpy"] = round(reference[what] / seconds, 1)
        rows_out.append(row)
    report = {
        "shape": [rows, cols],
        "codebook": args.codebook,
        "blocksize": blocksize,
        "device": args.device,
        "simd": _core.simd_level() if args.device == "cpu" else None,
        "results": rows_out,
    }
    if args.json:
        print_json(report)
        return 0
    headers = ["operation", "Melem/s", "numpy Melem/s", "x numpy"]
    table = [
        [
            r["what"],
            r["melem_per_s"],
            r.get("numpy_melem_per_s", "-"),
            r.get("speedup_vs_numpy", "-"),
        ]
        for r in rows_out
    ]
    print(f"{args.codebook}, blocksize {blocksize}, {rows}x{cols} float32 on {args.device}")
    print(format_table(headers, table))
    return 0
