"""Timing helpers shared by the benchmarks: warm up, repeat, take the median."""

from __future__ import annotations

import json
import platform
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
