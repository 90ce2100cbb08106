"""The trainer's attention on the GPU: the flash-attention kernels (train/_cuda.py) against
the chunked path (cuBLAS products + the fused softmax, `FusedSoftmax(flash=False)`).

    python3 benchmarks/attention_gpu.py [--seqs 2048,4096] [--step-seqs SEQS] [--layers 4]
        [--steps 5] [--no-step] [--variants] [--out FILE]

1. One layer's attention of the Llama-3.1-8B shape (32 query heads, 8 key/value heads, head
   dim 128, batch 1, bfloat16, causal): forward and backward at each sequence length, the
   median of CUDA-event timings, each path on the same arrays.
2. A whole QLoRA training step of the same shape with `--layers` decoder layers (the
   checkpoint of benchmarks/finetune_gpu.py: random bf16 weights, `Trainer.from_pretrained`,
   r=16 on all seven projections, NF4, gradient checkpointing), each path in turn on the same
   trainer: the median wall time of `--steps` steps after two warm-ups (each step ends on
   the loss read back to the host, as finetune_gpu.py times it), the loss of one batch by
   each path (on the same weights), and the pool's peak during one step. With `--baseline`,
   transformers' bf16-base LoRA on the same checkpoint (finetune_gpu.py's `peft_bf16` worker,
   in a process of its own).
3. `--variants`: the backward again with other dK/dV tile heights (head dim 128).

Writes a JSON file (benchmarks/results/attention_gpu.json by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def event_ms(fn: Callable[[], Any], repeat: int = 10) -> float:
    """Median milliseconds of fn() between two CUDA events, after one warm-up."""
    import cupy

    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return round(statistics.median(times), 3)


def layer_arrays(seq: int, d: int = HEAD_DIM) -> tuple[Any, ...]:
    import cupy
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(0)
    group = HEADS // KV_HEADS

    def normal(*shape: int) -> Any:
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16))

    q = normal(1, KV_HEADS, seq, group, d)
    k = normal(1, KV_HEADS, seq, d)
    v = normal(1, KV_HEADS, seq, d)
    do = normal(1, seq, KV_HEADS, group, d)
    return q, k, v, do


def layer_times(seq: int) -> dict[str, Any]:
    import cupy

    from nybble.train import _cuda
    from nybble.train import functional as F

    q, k, v, do = layer_arrays(seq)
    scale = HEAD_DIM**-0.5
    record: dict[str, Any] = {"seq": seq}
    paths: list[tuple[str, Any]] = [
        ("chunked", _cuda.FusedSoftmax(flash=False)),
        ("flash", _cuda.FusedSoftmax()),
    ]
    for name, softmax in paths:

        def forward(s: Any = softmax) -> Any:
            return F.attention_forward(cupy, q, k, v, scale, None, s)

        out, lse = forward()

        def backward(s: Any = softmax, out: Any = out, lse: Any = lse) -> Any:
            return F.attention_backward(cupy, do, q, k, v, out, lse, scale, None, s)

        fwd, bwd = event_ms(forward), event_ms(backward)
        record[name] = {"forward_ms": fwd, "backward_ms": bwd, "step_ms": round(2 * fwd + bwd, 3)}
    # a causal product of T x T x D per query head is 2 T^2 D / 2 flops
    product = HEADS * seq * seq * HEAD_DIM
    flash = record["flash"]
    flash["forward_tflops"] = round(2 * product / flash["forward_ms"] / 1e9, 1)
    flash["backward_tflops"] = round(7 * product / flash["backward_ms"] / 1e9, 1)
    record["speedup_step"] = round(record["chunked"]["step_ms"] / flash["step_ms"], 2)
    return record


def variant_times(seq: int, rows_options: tuple[int, ...]) -> list[dict[str, Any]]:
    """Backward times of head dim 128 with other dK/dV tile heights (recompiled)."""
    import cupy

    from nybble.train import _cuda
    from nybble.train import functional as F

    q, k, v, do = layer_arrays(seq)
    scale = HEAD_DIM**-0.5
    saved = (dict(_cuda.FLASH_DKDV_ROWS), _cuda.FLASH_COMPILE_OPTIONS)
    found = []
    try:
        for rows in rows_options:
            _cuda.FLASH_DKDV_ROWS[HEAD_DIM] = rows
            # the trainer's options with this tile (a new set of options: a new module)
            _cuda.FLASH_COMPILE_OPTIONS = (
                "-std=c++17",
                *(f"-DFLASH_DKDV_ROWS_{d}={r}" for d, r in _cuda.FLASH_DKDV_ROWS.items()),
                _cuda.FLUSH_TO_ZERO,
            )
            s: Any = _cuda.FusedSoftmax()
            out, lse = F.attention_forward(cupy, q, k, v, scale, None, s)

            def backward(s: Any = s, out: Any = out, lse: Any = lse) -> Any:
                return F.attention_backward(cupy, do, q, k, v, out, lse, scale, None, s)

            ms = event_ms(backward)
            found.append({"seq": seq, "dkdv_rows": rows, "backward_ms": ms})
    finally:
        _cuda.FLASH_DKDV_ROWS.clear()
        _cuda.FLASH_DKDV_ROWS.update(saved[0])
        _cuda.FLASH_COMPILE_OPTIONS = saved[1]
    return found


def step_times(seqs: list[int], layers: int, steps: int, baseline: bool) -> list[dict[str, Any]]:
    import cupy
    import finetune_gpu as fg
    from _gpu_memory import PoolPeak

    from nybble import LoraConfig
    from nybble.train import Trainer, _cuda

    folder = Path(tempfile.mkdtemp()) / "llama"
    t0 = time.perf_counter()
    fg.write_checkpoint("llama-3.1-8b", layers, folder)
    trainer = Trainer.from_pretrained(
        folder,
        LoraConfig(r=fg.R, alpha=2 * fg.R, target_modules="all-linear"),
        quant="nf4",
        device="cuda",
        lr=1e-4,
        compute_dtype="bfloat16",
        gradient_checkpointing=True,
    )
    print(f"checkpoint written and loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    records = []
    for seq in seqs:
        data = fg.batches(trainer.config.vocab_size, seq, steps + 3)
        record: dict[str, Any] = {"model": "llama-3.1-8b", "layers": layers, "seq": seq}
        paths = (("chunked", False), ("flash", True))
        losses = {}
        for name, flash in paths:  # one batch's loss on the same weights
            trainer.model.softmax = _cuda.FusedSoftmax(flash=flash)
            losses[name] = trainer.loss(*data[0])
        for name, flash in paths:
            trainer.model.softmax = _cuda.FusedSoftmax(flash=flash)
            for inputs, targets in data[:2]:
                trainer.train_batch(inputs, targets)
            times = []
            for inputs, targets in data[2:-1]:
                t0 = time.perf_counter()
                trainer.train_batch(inputs, targets)
                times.append(time.perf_counter() - t0)
            cupy.get_default_memory_pool().free_all_blocks()
            with PoolPeak() as peak:
                trainer.train_batch(*data[-1])
            record[name] = {
                "step_ms": round(statistics.median(times) * 1e3, 1),
                "steps_ms": [round(x * 1e3, 1) for x in times],
                "loss_first_batch": round(float(losses[name]), 5),
                "peak_allocated": peak.allocated,
                "peak_reserved": peak.reserved,
            }
            print(f"seq {seq} {name}: {record[name]}", flush=True)
        record["speedup"] = round(record["chunked"]["step_ms"] / record["flash"]["step_ms"], 2)
        if baseline:
            options = argparse.Namespace(steps=steps, new_tokens=0)
            record["peft_bf16"] = fg.spawn("peft_bf16", folder, seq, options, 300.0)
            print(f"seq {seq} peft_bf16: {record['peft_bf16']}", flush=True)
            if "step_ms" in record["peft_bf16"]:
                ours = record["flash"]["step_ms"]
                record["speedup_vs_peft_bf16"] = round(record["peft_bf16"]["step_ms"] / ours, 2)
        records.append(record)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="2048,4096")
    parser.add_argument("--step-seqs", default=None, help="the whole step's (default: --seqs)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-step", action="store_true", help="only the one-layer timings")
    parser.add_argument("--variants", action="store_true")
    parser.add_argument("--baseline", action="store_true", help="also transformers' bf16 LoRA")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "attention_gpu.json")
    args = parser.parse_args()
    import cupy

    seqs = [int(s) for s in args.seqs.split(",")]
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    result: dict[str, Any] = {
        "machine": f"{name} (CuPy {cupy.__version__})",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python3 benchmarks/attention_gpu.py " + " ".join(sys.argv[1:]),
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "batch": 1},
        "layer": [],
        "step": [],
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    for seq in seqs:
        result["layer"].append(layer_times(seq))
        print(json.dumps(result["layer"][-1]), flush=True)
        save()
    if not args.no_step:
        step_seqs = [int(s) for s in (args.step_seqs or args.seqs).split(",")]
        result["step"] = step_times(step_seqs, args.layers, args.steps, args.baseline)
        save()
    if args.variants:
        result["variants"] = variant_times(max(seqs), (32, 64))
        print(json.dumps(result["variants"]), flush=True)
        save()


if __name__ == "__main__":
    main()
