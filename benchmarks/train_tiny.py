"""Training throughput of the tiny model (docs/training.md) on the CPU or the GPU: tokens per
second of a whole training step (forward, backward, AdamW) for LoRA, QLoRA (NF4 base) and full
fine-tuning, at two batch shapes. Median of several steps after warm-up (each step ends with
the loss on the host, so GPU work is included); one process.

    python benchmarks/train_tiny.py [--device cpu|cuda] [--steps 20] [--out-dir DIR]

Writes train_tiny_<device>.json (into benchmarks/results/ by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from _timing import RESULTS, emit, machine

import nybble
from nybble import LoraConfig
from nybble.train import Trainer, TransformerConfig, corpus_batch

SHAPES = [(8, 64), (16, 256)]
MODES: dict[str, dict[str, Any]] = {
    "lora r=8 all-linear": dict(lora=LoraConfig(r=8, alpha=16, target_modules="all-linear")),
    "qlora r=8 all-linear (nf4)": dict(
        lora=LoraConfig(r=8, alpha=16, target_modules="all-linear"), quant="nf4"
    ),
    "full fine-tuning": dict(lora=None),
}


def measure(mode: str, batch: int, seq: int, steps: int, device: str = "cpu") -> dict[str, Any]:
    t = Trainer(TransformerConfig.tiny(), lr=1e-3, device=device, **MODES[mode])
    batches = [corpus_batch(i, batch, seq) for i in range(steps + 3)]
    for inputs, targets in batches[:3]:
        t.train_batch(inputs, targets)
    times = []
    for inputs, targets in batches[3:]:
        t0 = time.perf_counter()
        t.train_batch(inputs, targets)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return {
        "what": mode,
        "device": device,
        "compute_dtype": t.compute_dtype,
        "batch": batch,
        "seq_len": seq,
        "step_ms": round(step * 1e3, 3),
        "tokens_per_s": round(batch * seq / step),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    records: list[dict[str, Any]] = []
    for batch, seq in SHAPES:
        for mode in MODES:
            emit(measure(mode, batch, seq, args.steps, args.device), records)
    result = {
        "machine": machine(),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "nybble": nybble.__version__,
        "model": "tiny (hidden 64, 2 layers, 4 heads, vocab 256, intermediate 256)",
        "records": records,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"train_tiny_{args.device}.json").write_text(
        json.dumps(result, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
