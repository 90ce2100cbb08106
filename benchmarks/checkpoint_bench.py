"""Checkpoint tools on a large generated checkpoint: throughput (GB of input per second) and
peak RSS of `quantize`, `dequantize` and `merge`, each in a fresh process, against the
disk's sequential read speed measured in the same run, with the page cache dropped for the
files read (posix_fadvise DONTNEED after they are flushed). Optionally (the GPU machine) also
transformers + bitsandbytes quantizing the same checkpoint: `from_pretrained` with a
BitsAndBytesConfig, then `save_pretrained`.

The checkpoint is Llama-3.1-8B-shaped (hidden 4096, intermediate 14336, 32/8 heads, vocab
128256, bf16) with as many decoder layers as the size asks for, in 5 GB shards, and a PEFT
adapter (r=16 on the seven projections) for the merge.

    python benchmarks/checkpoint_bench.py --size-gb 8 --dir /tmp/nybble-ckpt-bench
    python benchmarks/checkpoint_bench.py --size-gb 3 --dir /tmp/ckb --transformers --device cuda

Targets (docs/checkpoints.md): peak RSS <= largest tensor + 512 MB; CPU quantize >= 50% of
the disk's sequential read speed; faster than the transformers + bitsandbytes route.
Writes benchmarks/results/checkpoint_cpu.json (checkpoint_gpu.json with --transformers), or
--out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _timing import machine, write_results

from nybble import safetensors_io
from nybble.checkpoint._output import DEFAULT_MAX_SHARD_SIZE, shard_names, shard_plan

SHAPE = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}
HEAD_DIM = 128
POOL_ELEMENTS = 64 * 2**20  # random bf16 values every tensor is cut from


# --- generating the checkpoint --------------------------------------------------------------


def parameters(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    q, kv = SHAPE["num_attention_heads"] * HEAD_DIM, SHAPE["num_key_value_heads"] * HEAD_DIM
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(layers):
        p = f"model.layers.{n}"
        out += [
            (f"{p}.self_attn.q_proj.weight", (q, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.mlp.gate_proj.weight", (i, h)),
            (f"{p}.mlp.up_proj.weight", (i, h)),
            (f"{p}.mlp.down_proj.weight", (h, i)),
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def layers_for(size_gb: float) -> int:
    per_layer = sum(math.prod(s) * 2 for n, s in parameters(1) if ".layers." in n)
    fixed = sum(math.prod(s) * 2 for n, s in parameters(0))
    return max(1, math.ceil((size_gb * 1e9 - fixed) / per_layer))


def _tensor(pool: np.ndarray, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    n = math.prod(shape)
    start = int(rng.integers(0, pool.size))
    return np.resize(np.roll(pool, -start)[: min(n, pool.size)], n).reshape(shape)


def generate(directory: Path, layers: int) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(POOL_ELEMENTS, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    params = parameters(layers)
    entries = [safetensors_io.Entry(n, "BF16", s) for n, s in params]
    plan = shard_plan(entries, DEFAULT_MAX_SHARD_SIZE)
    names = shard_names(len(plan))
    weight_map = {}
    for shard, file in zip(plan, names, strict=True):
        with safetensors_io.StreamWriter(directory / file, shard, {"format": "pt"}) as w:
            for e in shard:
                if e.name.endswith("norm.weight"):
                    w.write(e.name, np.ones(e.shape, ml_dtypes.bfloat16))
                else:
                    w.write(e.name, _tensor(pool, e.shape, rng))
                weight_map[e.name] = file
            os.replace(w.finish(), directory / file)
    total = sum(e.nbytes for e in entries)
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **SHAPE,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": layers,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    largest = max(e.nbytes for e in entries)
    return {"bytes": total, "tensors": len(entries), "layers": layers, "largest_tensor": largest}


def generate_adapter(directory: Path, layers: int, r: int = 16) -> int:
    rng = np.random.default_rng(1)
    tensors = {}
    for name, shape in parameters(layers):
        if ".layers." not in name or not name.endswith("_proj.weight"):
            continue
        out_f, in_f = shape
        key = "base_model.model." + name.removesuffix(".weight")
        tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((r, in_f), np.float32) / 64).astype(
            np.float32
        )
        tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out_f, r), np.float32) / 64).astype(
            np.float32
        )
    directory.mkdir(parents=True, exist_ok=True)
    safetensors_io.save(tensors, directory / "adapter_model.safetensors", {"format": "pt"})
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 2 * r,
        "lora_dropout": 0.0,
        "target_modules": [
            "down_proj",
            "gate_proj",
            "k_proj",
            "o_proj",
            "q_proj",
            "up_proj",
            "v_proj",
        ],
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return sum(t.nbytes for t in tensors.values())


# --- the page cache and the disk -------------------------------------------------------------


def drop_cache(directory: Path) -> None:
    """Flushes the files of a directory and asks the kernel to drop them from the page cache
    (clean pages go; what a read then costs is the disk's)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_speed(directory: Path) -> dict[str, float]:
    """Sequential read of the directory's safetensors files, cache dropped first."""
    drop_cache(directory)
    buf = bytearray(64 * 2**20)
    view = memoryview(buf)
    total = 0
    start = time.perf_counter()
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9}


# --- measurements, each in a fresh process ------------------------------------------------------


def peak_rss() -> int:
    """This process's peak resident set (VmHWM): unlike getrusage's ru_maxrss, which a
    child inherits from the parent it was forked from, it starts afresh at exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(args: argparse.Namespace) -> None:
    """One measurement: runs a tool in this process and prints its report with this
    process's peak RSS."""
    from nybble.checkpoint import dequantize_checkpoint, merge_adapter, quantize_checkpoint

    start = time.perf_counter()
    extra: dict[str, Any] = {}
    if args.child == "baseline":
        report = None
    elif args.child == "quantize":
        report = quantize_checkpoint(args.src, args.dst, layout=args.layout, device=args.device)
    elif args.child == "dequantize":
        report = dequantize_checkpoint(args.src, args.dst, device=args.device)
    elif args.child == "merge":
        report = merge_adapter(args.src, args.adapter, args.dst, device=args.device)
    else:  # transformers + bitsandbytes: load quantizing on the GPU, save
        import torch
        import transformers

        config = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=False,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.src, quantization_config=config, device_map="cuda", dtype=torch.bfloat16
        )
        loaded = time.perf_counter() - start
        model.save_pretrained(args.dst)
        extra = {"load_seconds": loaded, "gpu_peak_bytes": torch.cuda.max_memory_allocated()}
        report = None
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "peak_rss_bytes": peak_rss(), **extra}
    if report is not None:
        out.update(report=report.summary())
    print(json.dumps(out))


def measure(name: str, tool: str, src: Path, dst: Path | None, **options: Any) -> dict[str, Any]:
    if dst is not None:
        shutil.rmtree(dst, ignore_errors=True)
    drop_cache(src)
    argv = [sys.executable, __file__, "--child", tool, "--src", str(src)]
    if dst is not None:
        argv += ["--dst", str(dst)]
    for key, value in options.items():
        argv += [f"--{key}", str(value)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["name"] = name
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size-gb", type=float, default=8.0, help="size of the generated bf16 checkpoint"
    )
    p.add_argument("--dir", type=Path, default=Path("/tmp/nybble-checkpoint-bench"))
    p.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="also time nybble on this device"
    )
    p.add_argument(
        "--transformers", action="store_true", help="also time transformers + bitsandbytes"
    )
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument(
        "--vocab-size", type=int, default=SHAPE["vocab_size"], help="smaller for a quick trial"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="results file (default benchmarks/results/)"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--adapter", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--layout", default="nybble", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return

    started = time.perf_counter()
    SHAPE["vocab_size"] = args.vocab_size
    work = args.dir
    dense, adapter = work / "dense", work / "adapter"
    shutil.rmtree(work, ignore_errors=True)
    layers = layers_for(args.size_gb)
    t = time.perf_counter()
    ckpt = generate(dense, layers)
    adapter_bytes = generate_adapter(adapter, layers)
    print(json.dumps({"generated": ckpt, "seconds": time.perf_counter() - t}), flush=True)
    disk = read_speed(dense)
    print(json.dumps({"disk_read": disk}), flush=True)

    runs = [measure("baseline (python + nybble imported)", "baseline", dense, None)]
    runs.append(
        measure("quantize nybble nf4 (cpu)", "quantize", dense, work / "q", layout="nybble")
    )
    runs.append(measure("quantize bnb nf4 (cpu)", "quantize", dense, work / "qb", layout="bnb"))
    runs.append(measure("dequantize nybble -> bf16 (cpu)", "dequantize", work / "q", work / "d"))
    shutil.rmtree(work / "d", ignore_errors=True)
    runs.append(
        measure("merge lora r16 into bf16 (cpu)", "merge", dense, work / "m", adapter=adapter)
    )
    shutil.rmtree(work / "m", ignore_errors=True)
    if args.device == "cuda":
        runs.append(
            measure(
                "quantize bnb nf4 (cuda)",
                "quantize",
                dense,
                work / "qg",
                layout="bnb",
                device="cuda",
            )
        )
        runs.append(
            measure(
                "dequantize nybble -> bf16 (cuda)",
                "dequantize",
                work / "q",
                work / "dg",
                device="cuda",
            )
        )
        shutil.rmtree(work / "dg", ignore_errors=True)
    if args.transformers:
        runs.append(
            measure(
                "transformers + bitsandbytes: load nf4 + save_pretrained",
                "transformers",
                dense,
                work / "t",
            )
        )
    disk_after = read_speed(dense)

    largest = ckpt["largest_tensor"]
    for r in runs:
        report = r.get("report")
        read = report["bytes_read"] if report else ckpt["bytes"]
        r["input_gb_per_s"] = read / r["seconds"] / 1e9 if r["name"] != runs[0]["name"] else None
        r["peak_rss_over_largest_tensor_mb"] = (r["peak_rss_bytes"] - largest) / 2**20
    disk_gbs = min(disk["gb_per_s"], disk_after["gb_per_s"])
    quantize_cpu = runs[1]
    summary = {
        "disk_read_gb_per_s": disk_gbs,
        "quantize_cpu_over_disk_read": quantize_cpu["input_gb_per_s"] / disk_gbs,
        "target_quantize_cpu_at_least_half_the_disk": quantize_cpu["input_gb_per_s"]
        >= 0.5 * disk_gbs,
        "largest_tensor_mb": largest / 2**20,
        "target_peak_rss_within_largest_tensor_plus_512mb": all(
            r["peak_rss_bytes"] <= largest + 512 * 2**20
            for r in runs
            if r["name"].endswith("(cpu)")
        ),
    }
    if args.transformers:
        t_run = runs[-1]
        ours = next(
            r for r in runs if r["name"].startswith("quantize bnb") and r["name"].endswith("(cpu)")
        )
        summary["transformers_seconds_over_nybble_cpu"] = t_run["seconds"] / ours["seconds"]
        if args.device == "cuda":
            gpu = next(r for r in runs if r["name"] == "quantize bnb nf4 (cuda)")
            summary["transformers_seconds_over_nybble_cuda"] = t_run["seconds"] / gpu["seconds"]
    payload = {
        "machine": {**machine(), "load_average": os.getloadavg()},
        "checkpoint": {**ckpt, "adapter_bytes": adapter_bytes, "shape": SHAPE},
        "disk_read": [disk, disk_after],
        "runs": runs,
        "summary": summary,
        "wall_seconds": time.perf_counter() - started,
    }
    print(json.dumps({"summary": summary}), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    else:
        write_results("checkpoint_gpu" if args.transformers else "checkpoint_cpu", payload)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
