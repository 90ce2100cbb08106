"""CPU LoRA/QLoRA layer throughput against the same math in numpy (OpenBLAS), in one run,
and the peak extra memory of the QLoRA forward.

    python benchmarks/lora_cpu.py [--tokens 2048] [--features 4096] [--rank 16]

Prints one JSON object per measurement and a summary against the targets of
docs/benchmarks.md, and writes benchmarks/results/lora_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _timing import emit, machine, median_seconds, write_results

from nybble import LoraConfig, LoraLinear, QLoraLinear


def peak_rss_during(fn: Callable[[], Any]) -> tuple[int, int]:
    """(resident bytes before, peak resident bytes during fn()), via Linux's resettable
    high-water mark (writing 5 to /proc/self/clear_refs resets VmHWM)."""

    def status(field: str) -> int:
        text = Path("/proc/self/status").read_text()
        match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
        assert match, field
        return int(match.group(1)) * 1024

    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    fn()
    return before, status("VmHWM")


def qlora_forward_extra_memory(m: int, n: int, r: int) -> int:
    """Peak resident memory of a first QLoRA forward beyond its inputs and its output,
    measured in a fresh process (a warm allocator would hide the tile buffers)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import lora_cpu as b; "
        "print(b.probe(*map(int, sys.argv[2:])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), str(m), str(n), str(r)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


def probe(m: int, n: int, r: int) -> int:
    rng = np.random.default_rng(0)
    layer = QLoraLinear((rng.standard_normal((n, n)) * 0.02).astype(np.float32), LoraConfig(r=r))
    layer.eval()
    x = rng.standard_normal((m, n)).astype(np.float32)
    before, peak = peak_rss_during(lambda: layer.forward(x))
    return peak - before - m * n * 4  # the output [m, n] float32 is the result, not overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    m, n, r = args.tokens, args.features, args.rank
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, n)) * 0.02).astype(np.float32)
    x = rng.standard_normal((m, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    cfg = LoraConfig(r=r, alpha=2 * r)
    layer = LoraLinear(w, cfg).eval()
    layer.set_lora_b(rng.standard_normal((n, r)) * 0.01)
    a, b, s = layer.lora_a, layer.lora_b, layer.scaling
    sink: list[dict[str, Any]] = []
    times: dict[str, float] = {}

    def measure(what: str, fn: Callable[[], Any]) -> None:
        # OpenBLAS's idle threads spin for a while after each call and would steal the cores
        # from whatever runs next: let them settle before every measurement.
        time.sleep(0.3)
        times[what] = median_seconds(fn, args.repeat, warmup=1)
        emit({"what": what, "ms": times[what] * 1e3}, sink)

    # The same math in numpy: forward, backward (dx, grad_a, grad_b), merge.
    def numpy_forward() -> Any:
        return x @ w.T + s * ((x @ a.T) @ b.T)

    def numpy_backward() -> Any:
        h = x @ a.T
        grad_b = s * (dy.T @ h)
        gh = s * (dy @ b)
        grad_a = gh.T @ x
        return dy @ w + gh @ a, grad_a, grad_b

    def numpy_merge() -> Any:
        return w + s * (b @ a)

    def nybble_backward() -> Any:
        layer.forward(x)
        return layer.backward(dy)

    def numpy_forward_backward() -> Any:
        numpy_forward()
        return numpy_backward()

    def nybble_merge_unmerge() -> None:
        layer.merge()
        layer.unmerge()

    def numpy_merge_unmerge() -> None:
        merged = numpy_merge()
        merged - s * (b @ a)

    measure("numpy forward", numpy_forward)
    measure("nybble forward", lambda: layer.forward(x))
    measure("numpy forward+backward", numpy_forward_backward)
    measure("nybble forward+backward", nybble_backward)
    measure("numpy merge+unmerge", numpy_merge_unmerge)
    measure("nybble merge+unmerge", nybble_merge_unmerge)

    qlayer = QLoraLinear(w, cfg).eval()
    qlayer.set_lora_b(b)
    measure("nybble qlora forward", lambda: qlayer.forward(x))
    qlayer.train()
    measure("nybble qlora forward+backward", lambda: (qlayer.forward(x), qlayer.backward(dy)))
    qlayer.eval()

    extra = qlora_forward_extra_memory(m, n, r)
    emit(
        {"what": "qlora forward peak extra memory", "bytes": extra, "dense_weight_bytes": w.nbytes},
        sink,
    )

    summary = {
        "forward_vs_numpy": times["nybble forward"] / times["numpy forward"],
        "forward_backward_vs_numpy": times["nybble forward+backward"]
        / times["numpy forward+backward"],
        "merge_unmerge_vs_numpy": times["nybble merge+unmerge"] / times["numpy merge+unmerge"],
        "qlora_forward_vs_dense_numpy": times["nybble qlora forward"] / times["numpy forward"],
        "qlora_forward_extra_memory_vs_dense_weight": extra / w.nbytes,
    }
    targets = {
        "forward_vs_numpy": 1.1,
        "forward_backward_vs_numpy": 1.1,
        "merge_unmerge_vs_numpy": 1.1,
        "qlora_forward_vs_dense_numpy": 1.3,
        "qlora_forward_extra_memory_vs_dense_weight": 1 / 8,
    }
    emit({"summary": summary}, sink)
    print(f"\n{'ratio (time or memory, lower is better)':44s}{'measured':>10s}{'target':>10s}")
    for key, target in targets.items():
        print(f"{key:44s}{summary[key]:10.3f}{'<=':>4s}{target:6.3f}")
    path = write_results(
        "lora_cpu",
        {
            "machine": machine(),
            "shape": {"tokens": m, "features": n, "rank": r},
            "measurements": sink,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
