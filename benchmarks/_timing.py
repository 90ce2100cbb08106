"""Timing helpers shared by the benchmarks: warm up, repeat, take the median."""

from __future__ import annotations

import json
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def median_seconds(fn: Callable[[], Any], repeat: int = 7, warmup: int = 2) -> float:
    """Median wall time of `fn()` over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# kernel families by name (cuBLAS's and CUTLASS's products, attention, NCCL, 4-bit decoding)
KERNEL_KINDS = {
    "dense products": re.compile(r"nvjet|gemm|cutlass|xmma|cublas", re.I),
    "attention": re.compile(r"flash|fmha|attention|sdpa", re.I),
    "communication": re.compile(r"nccl", re.I),
    "4-bit decoding": re.compile(r"dequant|nf4|kgemv|4bit", re.I),
}


def kernel_profile(run: Callable[[], Any], top: int = 20) -> dict[str, Any]:
    """One call of `run` under torch's profiler (CUPTI sees every kernel of the process, CuPy's
    and the core's launches included): the kernels' summed time, per family of KERNEL_KINDS
    and by kernel, to tell a slower kernel from a longer wait between kernels."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
        rows = [
            (e.key, int(e.count), float(e.device_time_total))
            for e in prof.key_averages()
            if e.device_time_total > 0
        ]
    except Exception as e:  # torch absent or its profiler unable: the figure is left out
        return {"error": f"{type(e).__name__}: {e}"}
    rows.sort(key=lambda row: row[2], reverse=True)
    kinds: dict[str, float] = dict.fromkeys([*KERNEL_KINDS, "other"], 0.0)
    for name, _, us in rows:
        kind = next((k for k, pattern in KERNEL_KINDS.items() if pattern.search(name)), "other")
        kinds[kind] += us / 1e3
    return dict(
        kernels_ms=round(sum(r[2] for r in rows) / 1e3, 3),
        launches=sum(r[1] for r in rows),
        by_kind_ms={k: round(v, 3) for k, v in kinds.items()},
        top=[dict(kernel=k[:120], calls=c, total_us=round(t, 1)) for k, c, t in rows[:top]],
    )


def emit(record: dict[str, Any], sink: list[dict[str, Any]]) -> None:
    """Prints one measurement as a JSON line and keeps it for the results file."""
    print(json.dumps(record), flush=True)
    sink.append(record)


def machine() -> dict[str, Any]:
    import os

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
