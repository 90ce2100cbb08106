"""Fine-tuning and generation from a pretrained checkpoint on the GPU, as a user runs them:
`Trainer.from_pretrained` (QLoRA) against transformers + PEFT + bitsandbytes and against
transformers' bf16-base LoRA, and `generate` against transformers + bitsandbytes `generate`,
on the same checkpoint and GPU in the same run.

    python3 benchmarks/finetune_gpu.py [--models llama-3.1-8b,qwen2.5-7b] [--layers 4]
        [--seqs 2048,4096] [--steps 4] [--new-tokens 128] [--out-dir DIR]

Models: the Llama-3.1-8B and Qwen2.5-7B shapes (hidden, heads, intermediate, vocabulary, rope,
Qwen's q/k/v biases) with `--layers` decoder layers (the whole embedding and head), random
weights written once as a bf16 checkpoint folder that every side loads. Training: batch 1,
each sequence length, r=16 on all seven projections, alpha 32, NF4 base without double
quantization, bf16 compute, gradient checkpointing, AdamW; the median step of `--steps` after
two warm-ups, the loss on the host at the end of each. Memory: the peak of one steady step
(reserved) plus the process's memory outside the allocator (NVML). Generation: greedy, batch
1, a 32-token prompt, `--new-tokens` new tokens (no stop token), the model in NF4 (nybble's
frozen NF4 projections; bitsandbytes' Linear4bit), tokens per second of the decode steps.
Each side runs in a fresh process.

Writes finetune_gpu.json (into benchmarks/results/ by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _shapes import shapes, write_checkpoint

HERE = Path(__file__).parent
RESULTS = HERE / "results"
R = 16

MODELS = shapes("llama-3.1-8b", "qwen2.5-7b")


def nvml_process_bytes() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid():
                return int(p.usedGpuMemory)
    except Exception:  # NVML is optional: the figure is then absent
        return None
    return None


def batches(vocab: int, seq: int, count: int) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(1)
    out = []
    for _ in range(count):
        ids = rng.integers(0, vocab, (1, seq + 1))
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


# --- workers -----------------------------------------------------------------------------------


def nybble_train(folder: Path, seq: int, steps: int) -> dict[str, Any]:
    import cupy
    from _gpu_memory import PoolPeak

    from nybble import LoraConfig
    from nybble.train import Trainer

    t0 = time.perf_counter()
    trainer = Trainer.from_pretrained(
        folder,
        LoraConfig(r=R, alpha=2 * R, target_modules="all-linear"),
        quant="nf4",
        device="cuda",
        lr=1e-4,
        compute_dtype="bfloat16",
        gradient_checkpointing=True,
    )
    cupy.cuda.Device().synchronize()
    load_s = time.perf_counter() - t0
    data = batches(trainer.config.vocab_size, seq, steps + 3)
    for inputs, targets in data[:2]:
        trainer.train_batch(inputs, targets)
    times, losses = [], []
    for inputs, targets in data[2:-1]:
        t0 = time.perf_counter()
        losses.append(trainer.train_batch(inputs, targets))
        times.append(time.perf_counter() - t0)
    with PoolPeak() as peak:
        trainer.train_batch(*data[-1])
    outside = (nvml_process_bytes() or 0) - int(cupy.get_default_memory_pool().total_bytes())
    return dict(
        step_ms=round(statistics.median(times) * 1e3, 1),
        losses=[round(v, 4) for v in losses],
        load_s=round(load_s, 1),
        peak_reserved=peak.reserved,
        total=peak.reserved + max(outside, 0),
    )


def torch_train(folder: Path, seq: int, steps: int, quantized: bool) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    t0 = time.perf_counter()
    kwargs: dict[str, Any] = dict(device_map="cuda", dtype=torch.bfloat16)
    if quantized:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=False,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    model.config.use_cache = False
    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(
        model, LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=0.0, target_modules="all-linear")
    )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0

    def step(inputs: Any, targets: Any) -> float:
        ids = torch.from_numpy(inputs).to("cuda")
        labels = torch.from_numpy(targets).to("cuda")
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    data = batches(model.config.vocab_size, seq, steps + 3)
    for inputs, targets in data[:2]:
        step(inputs, targets)
    times, losses = [], []
    for inputs, targets in data[2:-1]:
        t0 = time.perf_counter()
        losses.append(step(inputs, targets))
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(*data[-1])
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved()
    outside = (nvml_process_bytes() or 0) - torch.cuda.memory_reserved()
    return dict(
        step_ms=round(statistics.median(times) * 1e3, 1),
        losses=[round(v, 4) for v in losses],
        load_s=round(load_s, 1),
        peak_reserved=reserved,
        total=reserved + max(outside, 0),
    )


def nybble_generate(folder: Path, new_tokens: int) -> dict[str, Any]:
    import numpy as np

    from nybble.train import Trainer

    t = Trainer.from_pretrained(
        folder, None, quant="nf4", device="cuda", frozen=True, compute_dtype="bfloat16"
    )
    prompt = np.random.default_rng(2).integers(0, t.config.vocab_size, 32).tolist()
    t.generate(prompt, max_new_tokens=8)  # warm-up: kernels compiled, pools filled
    runs = [t.generate(prompt, max_new_tokens=new_tokens) for _ in range(3)]
    return dict(
        tokens_per_s=round(statistics.median(r.tokens_per_second for r in runs), 1),
        new_tokens=len(runs[-1].ids),
        prefill_ms=round(statistics.median(r.prefill_seconds for r in runs) * 1e3, 1),
        ids=runs[-1].ids[:16],
    )


def torch_generate(folder: Path, new_tokens: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(folder),
        device_map="cuda",
        dtype=torch.bfloat16,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=False,
            bnb_4bit_compute_dtype=torch.bfloat16,
        ),
    )
    model.eval()
    prompt = np.random.default_rng(2).integers(0, model.config.vocab_size, 32).tolist()
    ids = torch.tensor([prompt], device="cuda")
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def run(n: int) -> tuple[float, float, list[int]]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        # decode steps only: the n-token call less the 1-token call (the prompt's pass)
        return (n - 1) / max((t2 - t1) - (t1 - t0), 1e-9), (t1 - t0), out[0, 32:].tolist()

    run(8)
    runs = [run(new_tokens) for _ in range(3)]
    return dict(
        tokens_per_s=round(statistics.median(r[0] for r in runs), 1),
        new_tokens=new_tokens,
        prefill_ms=round(statistics.median(r[1] for r in runs) * 1e3, 1),
        ids=runs[-1][2][:16],
    )


def worker(kind: str, folder: Path, seq: int, steps: int, new_tokens: int) -> None:
    sys.path.insert(0, str(HERE))
    if kind == "nybble":
        rec = nybble_train(folder, seq, steps)
    elif kind in ("peft_bnb", "peft_bf16"):
        rec = torch_train(folder, seq, steps, quantized=kind == "peft_bnb")
    elif kind == "nybble_generate":
        rec = nybble_generate(folder, new_tokens)
    else:
        rec = torch_generate(folder, new_tokens)
    print("RESULT " + json.dumps(rec), flush=True)


# --- the parent: never touches the GPU -----------------------------------------------------------


def spawn(
    kind: str, folder: Path, seq: int, args: argparse.Namespace, left: float
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", kind, "--folder", str(folder), "--seq", str(seq)]
    cmd += ["--steps", str(args.steps), "--new-tokens", str(args.new_tokens)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(left, 20.0))
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    return {"error": f"exit {p.returncode}: {p.stderr.strip()[-1200:]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seqs", default="2048,4096")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sides", default="nybble,peft_bnb,peft_bf16")
    parser.add_argument("--no-generate", dest="generate", action="store_false")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--deadline-s", type=float, default=560.0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.folder, args.seq, args.steps, args.new_tokens)
        return
    deadline = time.monotonic() + args.deadline_s
    records = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory(
            dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        ) as d:
            folder = Path(d) / name
            fields = dict(MODELS[name], num_hidden_layers=args.layers, torch_dtype="bfloat16")
            write_checkpoint(fields, folder)
            for seq in (int(s) for s in args.seqs.split(",") if s):
                rec: dict[str, Any] = {"model": name, "layers": args.layers, "seq": seq}
                for side in args.sides.split(","):
                    rec[side] = spawn(side, folder, seq, args, deadline - time.monotonic())
                ours, bnb, bf16 = (
                    rec.get("nybble", {}),
                    rec.get("peft_bnb", {}),
                    rec.get("peft_bf16", {}),
                )
                if "step_ms" in ours and "step_ms" in bnb:
                    rec["speedup_vs_peft_bnb"] = round(bnb["step_ms"] / ours["step_ms"], 2)
                    rec["memory_vs_peft_bnb"] = round(ours["total"] / bnb["total"], 3)
                if "step_ms" in ours and "step_ms" in bf16:
                    rec["speedup_vs_peft_bf16"] = round(bf16["step_ms"] / ours["step_ms"], 2)
                print(json.dumps(rec), flush=True)
                records.append(rec)
            if args.generate:
                rec = {"model": name, "layers": args.layers, "generate": True}
                rec["nybble"] = spawn(
                    "nybble_generate", folder, 0, args, deadline - time.monotonic()
                )
                rec["bnb"] = spawn("bnb_generate", folder, 0, args, deadline - time.monotonic())
                if "tokens_per_s" in rec["nybble"] and "tokens_per_s" in rec["bnb"]:
                    rec["speedup"] = round(
                        rec["nybble"]["tokens_per_s"] / rec["bnb"]["tokens_per_s"], 2
                    )
                print(json.dumps(rec), flush=True)
                records.append(rec)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "finetune_gpu.json"
    out.write_text(json.dumps({"records": records}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
