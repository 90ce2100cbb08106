"""Measure the GPU memory of nybble's own trainer (`nybble.train.Trainer` on CuPy), the runs the
estimator's `framework="nybble"` is compared with (docs/estimator.md):

    python3 benchmarks/memory/measure_nybble.py --out $OUT [--configs FILE] [--trace]

Each configuration runs in a fresh process: build the trainer (random weights, the base
quantized on the host and copied to the GPU), train `--steps` steps (3 by default) on random
token batches, and after each step read CuPy's pool and NVML:
- the pool's allocated peak of the step (bytes handed out and not yet freed, at their
  highest; the pool's 512-byte rounded sizes, as `_gpu_memory.PoolPeak` counts them) and its
  reserved peak (bytes the pool holds from the driver, `total_bytes()`, at their highest);
- NVML's memory of the process right after the step, and the pool's `total_bytes()` then: the
  difference is the memory outside the pool (CUDA context, kernel modules, cuBLAS).
The figure compared with `estimate_memory(..., framework="nybble").total_bytes` is the last
step's reserved peak plus that outside part.

With `--trace`, every allocation and free of the whole run (setup included) is written to
`traces/<name>.json.gz`: [op, pointer, bytes, step, site] with the site the innermost nybble
source line that asked for it, to compare with the estimator's recording of the trainer
event by event.

Writes OUT/results.jsonl (one record per configuration, appended as each ends) and, at the
end, OUT/comparison.jsonl: each run against its estimate (`--compare RESULTS` makes that
table again anywhere, without a GPU). The committed runs are the tests' fixtures:
tests/fixtures/memory/nybble/ (dev.jsonl, holdout.jsonl, traces/).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from train_gpu import CASES, nvml_process_bytes  # noqa: E402

#: The training benchmark's two cases (train_gpu.py): the whole Qwen3-0.6B and one Qwen3-4B layer.
QWEN3_06B = CASES["qwen3-0.6b"]["model"]
QWEN3_4B_LAYER = CASES["layer"]["model"]
TINYLLAMA = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=32000,
    tie_word_embeddings=False,
    qk_norm=False,
    model_type="llama",
    rope_theta=1e4,
)

LLAMA32_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    tie_word_embeddings=True,
    qk_norm=False,
    model_type="llama",
    rope_theta=5e5,
)
QWEN3_17B = dict(QWEN3_06B, hidden_size=2048, intermediate_size=6144)

#: The configurations, in two sets. "dev": the runs whose allocation traces the estimator was
#: first written against (it now records the trainer's own allocations, which the traces check
#: event by event). "holdout": runs measured only after it was written, to validate it
#: (docs/estimator.md).
CONFIGS: dict[str, list[dict[str, Any]]] = {
    "dev": [
        dict(name="qwen3-0.6b-2048-gc", model=QWEN3_06B, batch=1, seq=2048, gc=True),
        dict(name="qwen3-0.6b-2048", model=QWEN3_06B, batch=1, seq=2048, gc=False),
        dict(name="qwen3-4b-layer-4096", model=QWEN3_4B_LAYER, batch=1, seq=4096, gc=False),
        dict(name="tinyllama-2x1024-bf16", model=TINYLLAMA, batch=2, seq=1024, gc=True, quant=None),
    ],
    "holdout": [
        dict(name="qwen3-0.6b-4x512-gc-r64", model=QWEN3_06B, batch=4, seq=512, gc=True, r=64),
        dict(
            name="qwen3-0.6b-1024-qv-dq",
            model=QWEN3_06B,
            batch=1,
            seq=1024,
            gc=False,
            targets=["q_proj", "v_proj"],
            double_quant=True,
        ),
        dict(
            name="qwen3-0.6b-2048-gc-dropout",
            model=QWEN3_06B,
            batch=1,
            seq=2048,
            gc=True,
            dropout=0.1,
        ),
        dict(
            name="qwen3-0.6b-1024-f32",
            model=QWEN3_06B,
            batch=1,
            seq=1024,
            gc=True,
            compute_dtype="float32",
        ),
        dict(name="tinyllama-4096-gc", model=TINYLLAMA, batch=1, seq=4096, gc=True),
        dict(name="llama3.2-1b-4096-gc-r8", model=LLAMA32_1B, batch=1, seq=4096, gc=True, r=8),
        dict(
            name="qwen3-1.7b-2x1024",
            model=QWEN3_17B,
            batch=2,
            seq=1024,
            gc=False,
            targets=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),
    ],
}


def settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """`estimate_memory`'s arguments for a configuration (its model first)."""
    from nybble.train import TransformerConfig

    return dict(
        model=TransformerConfig(**cfg["model"]).to_hf(),
        quant=cfg.get("quant", "nf4") or "bfloat16",
        double_quant=bool(cfg.get("double_quant", False)),
        lora_r=int(cfg.get("r", 16)),
        targets=cfg.get("targets", "all-linear"),
        lora_dropout=float(cfg.get("dropout", 0.0)),
        batch=cfg["batch"],
        seq_len=cfg["seq"],
        grad_checkpointing=cfg["gc"],
        compute_dtype=cfg.get("compute_dtype", "bfloat16"),
    )


def estimate(cfg: dict[str, Any]) -> Any:
    """`estimate_memory(..., framework="nybble")` for a configuration (runs anywhere)."""
    from nybble.memory import estimate_memory

    args = settings(cfg)
    return estimate_memory(args.pop("model"), framework="nybble", **args)


def compare(results: Path) -> list[dict[str, Any]]:
    """Each measured run against its estimate: allocated peak, reserved peak, total."""
    rows = []
    for line in results.read_text().splitlines():
        rec = json.loads(line)
        if "error" in rec:
            rows.append(dict(name=rec["name"], error=rec["error"][-300:]))
            continue
        est = estimate(rec["config"])
        row: dict[str, Any] = dict(name=rec["name"], set=rec["config"].get("set", ""))
        for what, got, want in (
            ("allocated", est.allocated_peak_bytes, rec["peak_allocated"]),
            ("reserved", est.reserved_peak_bytes, rec["peak_reserved"]),
            ("total", est.total_bytes, rec["total"]),
        ):
            row[f"{what}_estimated"] = got
            row[f"{what}_measured"] = want
            row[f"{what}_error"] = None if want is None else round(got / want - 1, 5)
        rows.append(row)
    return rows


def _site(package: str) -> str:
    """The innermost line of the nybble package on the stack (the trainer's code, not CuPy's)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(package):
            return f"{name[len(package) :]}:{f.f_lineno}:{f.f_code.co_name}"
        f = f.f_back
    return "?"


def measure(cfg: dict[str, Any], steps: int, trace: bool) -> dict[str, Any]:
    import cupy
    import numpy as np
    from cupy.cuda import MemoryHook

    import nybble
    from nybble import LoraConfig
    from nybble.train import Trainer, TransformerConfig

    package = os.path.dirname(nybble.__file__) + os.sep
    pool = cupy.get_default_memory_pool()

    class Recorder(MemoryHook):  # type: ignore[misc]
        name = "Recorder"

        def __init__(self) -> None:
            self.live: dict[int, int] = {}
            self.used = 0
            self.allocated = 0
            self.reserved = 0
            self.step = 0
            self.events: list[list[Any]] = []

        def reset(self) -> None:
            self.allocated = self.used
            self.reserved = int(pool.total_bytes())

        def malloc_postprocess(self, **kw: Any) -> None:
            self.live[kw["mem_ptr"]] = kw["mem_size"]
            self.used += kw["mem_size"]
            self.allocated = max(self.allocated, self.used)
            if trace:
                self.events.append(["a", kw["mem_ptr"], kw["mem_size"], self.step, _site(package)])

        def alloc_postprocess(self, **kw: Any) -> None:
            self.reserved = max(self.reserved, int(pool.total_bytes()))

        def free_postprocess(self, **kw: Any) -> None:
            size = self.live.pop(kw["mem_ptr"], None)
            if size is not None:
                self.used -= size
                if trace:
                    self.events.append(["f", kw["mem_ptr"], size, self.step, ""])

    cupy.zeros(1)  # the context, before the recorder
    rec = Recorder()
    nvml_context = nvml_process_bytes()
    r = int(cfg.get("r", 16))
    targets = cfg.get("targets", "all-linear")
    t0 = time.perf_counter()
    with rec:
        trainer = Trainer(
            TransformerConfig(**cfg["model"]),
            LoraConfig(
                r=r, alpha=2 * r, dropout=float(cfg.get("dropout", 0.0)), target_modules=targets
            ),
            lr=1e-4,
            quant=cfg.get("quant", "nf4"),
            device="cuda",
            compute_dtype=cfg.get("compute_dtype", "bfloat16"),
            gradient_checkpointing=cfg["gc"],
            double_quant=bool(cfg.get("double_quant", False)),
        )
        cupy.cuda.Device().synchronize()
        setup = dict(
            allocated=int(pool.used_bytes()),
            reserved=int(pool.total_bytes()),
            peak_allocated=rec.allocated,
            peak_reserved=rec.reserved,
            nvml=nvml_process_bytes(),
            seconds=round(time.perf_counter() - t0, 2),
        )
        rng = np.random.default_rng(0)
        vocab = cfg["model"]["vocab_size"]
        per_step = []
        for step in range(1, steps + 1):
            ids = rng.integers(0, vocab, (cfg["batch"], cfg["seq"] + 1))
            cupy.cuda.Device().synchronize()
            rec.step = step
            rec.reset()
            t0 = time.perf_counter()
            loss = trainer.train_batch(ids[:, :-1], ids[:, 1:])
            cupy.cuda.Device().synchronize()
            seconds = time.perf_counter() - t0
            rec.reserved = max(rec.reserved, int(pool.total_bytes()))
            nvml = nvml_process_bytes()
            total = int(pool.total_bytes())
            per_step.append(
                dict(
                    step=step,
                    loss=round(float(loss), 5),
                    seconds=round(seconds, 4),
                    peak_allocated=rec.allocated,
                    peak_reserved=rec.reserved,
                    allocated_after=int(pool.used_bytes()),
                    reserved_after=total,
                    nvml=nvml,
                    outside=None if nvml is None else nvml - total,
                )
            )
    last = per_step[-1]
    out = dict(
        name=cfg["name"],
        config=cfg,
        setup=setup,
        nvml_context=nvml_context,
        steps=per_step,
        peak_allocated=last["peak_allocated"],
        peak_reserved=last["peak_reserved"],
        outside=last["outside"],
        total=None if last["outside"] is None else last["peak_reserved"] + last["outside"],
        versions=dict(cupy=cupy.__version__, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion()),
        device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
    )
    if trace:
        out["events"] = rec.events
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--configs", type=Path, help="a JSON list of configurations")
    ap.add_argument("--sets", default="dev,holdout", help="which sets of CONFIGS to measure")
    ap.add_argument("--only", help="comma-separated names of configurations")
    ap.add_argument(
        "--compare",
        type=Path,
        metavar="RESULTS",
        help="only compare a results.jsonl with the estimates (no GPU needed)",
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trace", action="store_true", help="write every allocation's trace")
    ap.add_argument("--timeout-s", type=int, default=300)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a worker: one configuration as JSON
    args = ap.parse_args()
    if args.one:
        cfg = json.loads(args.one)
        try:
            rec = measure(cfg, args.steps, args.trace)
        except Exception:
            rec = dict(name=cfg["name"], config=cfg, error=traceback.format_exc(limit=8))
        events = rec.pop("events", None)
        if events is not None:
            traces = args.out / "traces"
            traces.mkdir(parents=True, exist_ok=True)
            with gzip.open(traces / f"{cfg['name']}.json.gz", "wt") as f:
                json.dump(events, f)
        with open(args.out / "results.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        return
    if args.compare:
        for row in compare(args.compare):
            print(json.dumps(row))
        return
    if args.configs:
        configs = json.loads(args.configs.read_text())
    else:
        configs = [dict(c, set=k) for k in args.sets.split(",") for c in CONFIGS[k]]
    if args.only:
        wanted = set(args.only.split(","))
        configs = [c for c in configs if c["name"] in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    for cfg in configs:
        cmd = [
            sys.executable,
            __file__,
            "--out",
            str(args.out),
            "--steps",
            str(args.steps),
            "--one",
            json.dumps(cfg),
        ]
        if args.trace:
            cmd.append("--trace")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=args.timeout_s, capture_output=True, text=True)
            status = f"exit {proc.returncode}"
            if proc.returncode:
                print(proc.stderr[-2000:], file=sys.stderr)
        except subprocess.TimeoutExpired:
            status = "timed out"
            with open(args.out / "results.jsonl", "a") as f:
                f.write(json.dumps(dict(name=cfg["name"], config=cfg, error=status)) + "\n")
        print(f"{cfg['name']}: {status} in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = compare(args.out / "results.jsonl")
    with open(args.out / "comparison.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row))


if __name__ == "__main__":
    main()
