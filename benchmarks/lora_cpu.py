"""CPU LoRA/QLoRA layer throughput against the same math in numpy (OpenBLAS), in one run,
and the peak extra memory of the QLoRA forward, for each instruction set of the core's dense
products that this CPU has (AVX-512 and AVX2 on an AVX-512 machine: `NYBBLE_CPU_ISA`).

    python benchmarks/lora_cpu.py [--tokens 2048] [--features 4096] [--rank 16]
                                  [--repeat 7] [--rounds 3] [--isa all|avx512|avx2|...]

Each instruction set runs in a process of its own (the core reads `NYBBLE_CPU_ISA` once), the
sets taking turns for `--rounds` rounds. Inside a process each nybble measurement and its numpy
comparison are timed in alternation, call for call, so that the other work on a shared machine
falls on both alike; a ratio is the median of nybble's times over the median of numpy's.
Prints one JSON object per measurement and a summary (each ratio's median over the rounds, and
its range) against the targets of docs/benchmarks.md, and writes
benchmarks/results/lora_cpu.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _timing import emit, machine, write_results

TARGETS = {
    "forward_vs_numpy": 1.1,
    "forward_backward_vs_numpy": 1.0,
    "merge_unmerge_vs_numpy": 1.1,
    "qlora_forward_vs_dense_numpy": 1.2,
    "qlora_forward_extra_memory_vs_dense_weight": 1 / 8,
}


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
    from nybble import LoraConfig, QLoraLinear

    rng = np.random.default_rng(0)
    layer = QLoraLinear((rng.standard_normal((n, n)) * 0.02).astype(np.float32), LoraConfig(r=r))
    layer.eval()
    x = rng.standard_normal((m, n)).astype(np.float32)
    before, peak = peak_rss_during(lambda: layer.forward(x))
    return peak - before - m * n * 4  # the output [m, n] float32 is the result, not overhead


def cpu_model() -> str | None:
    """The CPU's model name and whether it has AVX-512 (Linux)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = re.search(r"^flags\s*:(.*)$", info, re.M)
    wide = flags is not None and " avx512f" in flags.group(1)
    return f"{model.group(1) if model else '?'} ({'AVX-512' if wide else 'no AVX-512'})"


def openblas_kernels() -> str | None:
    """The kernel family numpy's OpenBLAS chose for this CPU ("SkylakeX", "Haswell", ...),
    where the loaded library tells it."""
    np.ones((2, 2)) @ np.ones((2, 2))  # loads the BLAS
    paths = {p for p in Path("/proc/self/maps").read_text().split() if "openblas" in p}
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        for prefix in ("scipy_", ""):
            for suffix in ("64_", ""):
                fn = getattr(lib, f"{prefix}openblas_get_corename{suffix}", None)
                if fn is not None:
                    fn.restype = ctypes.c_char_p
                    return str(fn().decode())
    return None


def paired_medians(a: Callable[[], Any], b: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Median seconds of `a()` and of `b()`, called in alternation (a b, b a, ...) after one
    warm-up each."""
    times: tuple[list[float], list[float]] = ([], [])
    fns = (a, b)
    for i in range(repeat + 1):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            # OpenBLAS's idle threads spin for a while after each call and would steal the
            # cores from whatever runs next (rayon's spin less): let them settle first.
            time.sleep(0.3)
            t0 = time.perf_counter()
            fns[which]()
            if i:  # the first round is the warm-up
                times[which].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def measure_once(m: int, n: int, r: int, repeat: int, memory: bool) -> dict[str, Any]:
    """One round at the instruction set this process's core uses."""
    from nybble import LoraConfig, LoraLinear, QLoraLinear, _core

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, n)) * 0.02).astype(np.float32)
    x = rng.standard_normal((m, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    cfg = LoraConfig(r=r, alpha=2 * r)
    layer = LoraLinear(w, cfg)
    layer.eval()
    layer.set_lora_b(rng.standard_normal((n, r)) * 0.01)
    a, b, s = layer.lora_a, layer.lora_b, layer.scaling
    isa = _core.matmul_isa()
    sink: list[dict[str, Any]] = []
    ms: dict[str, float] = {}

    def pair(what: str, numpy_fn: Callable[[], Any], nybble_fn: Callable[[], Any]) -> None:
        ms[f"numpy {what}"], ms[f"nybble {what}"] = (
            1e3 * t for t in paired_medians(numpy_fn, nybble_fn, repeat)
        )
        for who in ("numpy", "nybble"):
            emit({"isa": isa, "what": f"{who} {what}", "ms": ms[f"{who} {what}"]}, sink)

    # The same math in numpy: forward, backward (dx, grad_a, grad_b), merge.
    def numpy_forward() -> Any:
        return x @ w.T + s * ((x @ a.T) @ b.T)

    def numpy_backward() -> Any:
        h = x @ a.T
        grad_b = s * (dy.T @ h)
        gh = s * (dy @ b)
        grad_a = gh.T @ x
        return dy @ w + gh @ a, grad_a, grad_b

    def numpy_forward_backward() -> Any:
        numpy_forward()
        return numpy_backward()

    def numpy_merge_unmerge() -> None:
        merged = w + s * (b @ a)
        merged - s * (b @ a)

    def nybble_forward_backward() -> Any:
        layer.forward(x)
        return layer.backward(dy)

    def nybble_merge_unmerge() -> None:
        layer.merge()
        layer.unmerge()

    qlayer = QLoraLinear(w, cfg).eval()
    qlayer.set_lora_b(b)

    def qlora_forward_backward() -> Any:
        qlayer.train()
        qlayer.forward(x)
        qlayer.backward(dy)
        qlayer.eval()

    pair("forward", numpy_forward, lambda: layer.forward(x))
    pair("forward+backward", numpy_forward_backward, nybble_forward_backward)
    pair("merge+unmerge", numpy_merge_unmerge, nybble_merge_unmerge)
    # QLoRA against dense numpy: the same numpy functions, timed again beside the QLoRA layer.
    pair("qlora forward", numpy_forward, lambda: qlayer.forward(x))
    pair("qlora forward+backward", numpy_forward_backward, qlora_forward_backward)
    summary = {
        "forward_vs_numpy": ms["nybble forward"] / ms["numpy forward"],
        "forward_backward_vs_numpy": ms["nybble forward+backward"] / ms["numpy forward+backward"],
        "merge_unmerge_vs_numpy": ms["nybble merge+unmerge"] / ms["numpy merge+unmerge"],
        "qlora_forward_vs_dense_numpy": ms["nybble qlora forward"] / ms["numpy qlora forward"],
        "qlora_forward_backward_vs_dense_numpy": ms["nybble qlora forward+backward"]
        / ms["numpy qlora forward+backward"],
    }
    if memory:
        extra = qlora_forward_extra_memory(m, n, r)
        emit({"isa": isa, "what": "qlora forward peak extra memory", "bytes": extra}, sink)
        summary["qlora_forward_extra_memory_vs_dense_weight"] = extra / w.nbytes
    emit({"isa": isa, "summary": summary}, sink)
    return {"isa": isa, "load_average": os.getloadavg(), "ms": ms, "summary": summary}


def instruction_sets() -> list[str]:
    """The core's instruction sets for the dense products that this CPU has, widest first
    (AVX-512 and AVX2 where it has AVX-512; otherwise its one set)."""
    out = subprocess.run(
        [sys.executable, "-c", "from nybble import _core; print(_core.matmul_isa())"],
        check=True, capture_output=True, text=True, env={**os.environ, "NYBBLE_CPU_ISA": ""},
    )  # fmt: skip
    best = out.stdout.strip()
    return ["avx512", "avx2"] if best == "avx512" else [best]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--isa", default="all", help="all, or one: avx512, avx2, neon, scalar")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    m, n, r = args.tokens, args.features, args.rank
    if args.child:
        result = measure_once(m, n, r, args.repeat, memory=args.memory)
        print("RESULT " + json.dumps(result), flush=True)
        return
    isas = instruction_sets() if args.isa == "all" else [args.isa]
    sink: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {isa: [] for isa in isas}
    for round_ in range(args.rounds):
        for isa in isas if round_ % 2 == 0 else isas[::-1]:
            child = subprocess.run(
                [sys.executable, __file__, "--child", "--tokens", str(m), "--features", str(n),
                 "--rank", str(r), "--repeat", str(args.repeat),
                 *(["--memory"] if round_ == 0 else [])],
                check=True, capture_output=True, text=True,
                env={**os.environ, "NYBBLE_CPU_ISA": isa},
            )  # fmt: skip
            for line in child.stdout.splitlines():
                if line.startswith("RESULT "):
                    result = json.loads(line.removeprefix("RESULT "))
                    if result["isa"] != isa:
                        sys.exit(f"asked for {isa}, the core ran {result['isa']}")
                    runs[isa].append({"round": round_, **result})
                else:
                    print(line, flush=True)
                    sink.append({"round": round_, **json.loads(line)})
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for isa, results in runs.items():
        summary[isa] = {}
        for key in results[0]["summary"]:
            values = [res["summary"][key] for res in results if key in res["summary"]]
            summary[isa][key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
    emit({"summary": summary}, sink)
    print(
        f"\n{'ratio (time or memory, lower is better)':44s}{'isa':>8s}{'median':>9s}"
        f"{'range':>15s}{'target':>10s}"
    )
    for isa in isas:
        for key, stat in summary[isa].items():
            target = f"<= {TARGETS[key]:.3f}" if key in TARGETS else ""
            spread = f"{stat['min']:.3f}-{stat['max']:.3f}"
            print(f"{key:44s}{isa:>8s}{stat['median']:9.3f}{spread:>15s}{target:>10s}")
    path = write_results(
        "lora_cpu",
        {
            "machine": {
                **machine(),
                "model": cpu_model(),
                "numpy_openblas_kernels": openblas_kernels(),
            },
            "command": " ".join(["python", "benchmarks/lora_cpu.py", *sys.argv[1:]]),
            "shape": {"tokens": m, "features": n, "rank": r},
            "targets": TARGETS,
            "rounds": args.rounds,
            "repeat": args.repeat,
            "summary": summary,
            "runs": runs,
            "measurements": sink,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
