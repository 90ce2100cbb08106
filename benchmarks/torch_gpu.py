"""nybble inside transformers + PEFT against bitsandbytes on the GPU, as a QLoRA user runs
them: the same `from_pretrained` / `get_peft_model` / training step / `generate`, with
`quantization_config=nybble.torch.NybbleConfig(...)` on one side and
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", ...)` on the other, on the
same checkpoint and GPU in the same run.

    python3 benchmarks/torch_gpu.py [--models llama-3.1-8b,qwen3-4b] [--layers 4]
        [--seq 2048] [--steps 4] [--new-tokens 128] [--sides nybble,bnb] [--out-dir DIR]

Models: the Llama-3.1-8B and Qwen3-4B shapes (hidden, heads, head_dim, intermediate,
vocabulary, rope, Qwen3's q/k norms and tied embeddings) with `--layers` decoder layers (the
whole embedding and head), random weights written once as a bf16 checkpoint folder that
every side loads. Training step: batch 1 of `--seq` tokens, LoRA r=16 alpha 32 on all seven
projections (`target_modules="all-linear"`), no dropout, NF4 with double quantization, bf16
compute, `prepare_model_for_kbit_training`, gradient checkpointing (use_reentrant=False, the
same call on both sides), torch AdamW, the loss from `labels`; the median step of `--steps`
after two warm-ups, and the peak memory of one steady step (torch's reserved and allocated
peaks, plus the process's memory outside the allocator from NVML where pynvml is present).
Generation: the quantized model without an adapter, greedy, batch 1, a 32-token prompt,
`--new-tokens` new tokens (no stop token), tokens per second of the decode steps (the
n-token call less the 1-token call), and the first generated ids of each side. Each side runs
in a fresh process; a side that fails records its error and the others go on.

Writes torch_gpu.json (into benchmarks/results/ by default).
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

HERE = Path(__file__).parent
RESULTS = HERE / "results"
R = 16
PROMPT = 32

MODELS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "qwen3-4b": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=2560,
        intermediate_size=9728,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
}


def write_checkpoint(name: str, layers: int, directory: Path) -> None:
    """Random weights (std 0.02, norms 1) as a bf16 safetensors checkpoint folder."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    fields = dict(MODELS[name], num_hidden_layers=layers, torch_dtype="bfloat16")
    h, i, d = fields["hidden_size"], fields["intermediate_size"], fields["head_dim"]
    heads, kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> Any:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    def ones(n: int) -> Any:
        return np.ones(n, ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(fields["vocab_size"], h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        tensors[p + "input_layernorm.weight"] = ones(h)
        tensors[p + "post_attention_layernorm.weight"] = ones(h)
        for proj, shape in {
            "self_attn.q_proj": (heads * d, h),
            "self_attn.k_proj": (kv * d, h),
            "self_attn.v_proj": (kv * d, h),
            "self_attn.o_proj": (h, heads * d),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }.items():
            tensors[p + proj + ".weight"] = normal(*shape)
        if fields["model_type"] == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = ones(d)
            tensors[p + "self_attn.k_norm.weight"] = ones(d)
    tensors["model.norm.weight"] = ones(h)
    if not fields["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(fields["vocab_size"], h)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(fields, indent=2))


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


# --- workers (one side, one process) ----------------------------------------------------------


def quantization_config(side: str, double_quant: bool) -> Any:
    import torch

    if side == "nybble":
        import nybble.torch

        return nybble.torch.NybbleConfig(double_quant=double_quant, compute_dtype=torch.bfloat16)
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def load(side: str, folder: Path, double_quant: bool) -> tuple[Any, float]:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(folder),
        quantization_config=quantization_config(side, double_quant),
        dtype=torch.bfloat16,
        device_map="cuda",
    )
    torch.cuda.synchronize()
    return model, time.perf_counter() - t0


def layer_count(model: Any, side: str) -> int:
    """The quantized projections of the side's kind (a check that the side is what it says)."""
    if side == "nybble":
        import nybble.torch

        kind: Any = nybble.torch.Linear4bit
    else:
        import bitsandbytes as bnb

        kind = bnb.nn.Linear4bit
    return sum(1 for m in model.modules() if isinstance(m, kind))


def train(side: str, folder: Path, seq: int, steps: int, double_quant: bool) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model, load_s = load(side, folder, double_quant)
    quantized = layer_count(model, side)
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    # PEFT turns checkpointing on in prepare_model_for_kbit_training only for the methods it
    # names (bitsandbytes among them): the same call on both sides makes the runs alike.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(
        r=R, lora_alpha=2 * R, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    if side == "nybble":
        import nybble.torch

        lora = nybble.torch.register_lora(lora)
    model = get_peft_model(model, lora)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)

    def step() -> float:
        ids = torch.randint(0, vocab, (1, seq), generator=generator).to("cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    for _ in range(2):
        step()
    times, losses = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved()
    allocated = torch.cuda.max_memory_allocated()
    nvml = nvml_process_bytes()
    outside = None if nvml is None else nvml - torch.cuda.memory_reserved()
    return dict(
        step_ms=round(statistics.median(times) * 1e3, 1),
        tokens_per_s=round(seq / statistics.median(times), 1),
        losses=[round(v, 4) for v in losses],
        load_s=round(load_s, 1),
        quantized_layers=quantized,
        trainable=sum(p.numel() for p in params),
        peak_reserved=reserved,
        peak_allocated=allocated,
        outside_allocator=outside,
        total=None if outside is None else reserved + max(outside, 0),
    )


def generate(side: str, folder: Path, new_tokens: int, double_quant: bool) -> dict[str, Any]:
    import torch

    model, load_s = load(side, folder, double_quant)
    quantized = layer_count(model, side)
    model.eval()
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=generator).to("cuda")
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
        return (n - 1) / max((t2 - t1) - (t1 - t0), 1e-9), (t1 - t0), out[0, PROMPT:].tolist()

    run(8)  # warm-up: kernels compiled and prepared, pools filled
    runs = [run(new_tokens) for _ in range(3)]
    return dict(
        tokens_per_s=round(statistics.median(r[0] for r in runs), 1),
        new_tokens=new_tokens,
        prefill_ms=round(statistics.median(r[1] for r in runs) * 1e3, 1),
        load_s=round(load_s, 1),
        quantized_layers=quantized,
        ids=runs[-1][2][:16],
    )


def worker(args: argparse.Namespace) -> None:
    side, task = args.worker.split(":")
    if task == "train":
        rec = train(side, args.folder, args.seq, args.steps, args.double_quant)
    else:
        rec = generate(side, args.folder, args.new_tokens, args.double_quant)
    import torch

    rec["device"] = torch.cuda.get_device_name()
    rec["torch"] = torch.__version__
    print("RESULT " + json.dumps(rec), flush=True)


# --- the parent: never touches the GPU ---------------------------------------------------------


def spawn(job: str, folder: Path, args: argparse.Namespace, left: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", job, "--folder", str(folder)]
    cmd += ["--seq", str(args.seq), "--steps", str(args.steps)]
    cmd += ["--new-tokens", str(args.new_tokens)]
    cmd += ["--double-quant" if args.double_quant else "--no-double-quant"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(left, 20.0))
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    return {"error": f"exit {p.returncode}: {p.stderr.strip()[-1500:]}"}


def ratio(rec: dict[str, Any], key: str, larger_is_better: bool) -> float | None:
    ours, theirs = rec.get("nybble", {}).get(key), rec.get("bnb", {}).get(key)
    if not ours or not theirs:
        return None
    return round(ours / theirs if larger_is_better else theirs / ours, 2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Needs a CUDA GPU with torch, transformers, peft, CuPy and nybble[torch]; "
        "bitsandbytes for the bnb side.",
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: %(default)s")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per training step")
    parser.add_argument("--steps", type=int, default=4, help="timed training steps")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated")
    parser.add_argument("--sides", default="nybble,bnb", help="comma-separated: %(default)s")
    parser.add_argument(
        "--double-quant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="double-quantized scales on both sides (default on, the QLoRA recipe)",
    )
    parser.add_argument("--no-train", dest="train", action="store_false", help="skip training")
    parser.add_argument("--no-generate", dest="generate", action="store_false")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--deadline-s", type=float, default=560.0, help="for all the runs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"unknown model(s) {', '.join(sorted(unknown))}; known: {', '.join(MODELS)}")
    sides = [s for s in args.sides.split(",") if s]
    if set(sides) - {"nybble", "bnb"}:
        parser.error("--sides takes nybble and bnb")
    deadline = time.monotonic() + args.deadline_s
    records = []
    for name in args.models.split(","):
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(dir=shm) as d:
            folder = Path(d) / name
            write_checkpoint(name, args.layers, folder)
            tasks = (["train"] if args.train else []) + (["generate"] if args.generate else [])
            for task in tasks:
                rec: dict[str, Any] = {"model": name, "layers": args.layers, "task": task}
                if task == "train":
                    rec["seq"] = args.seq
                for side in sides:
                    rec[side] = spawn(f"{side}:{task}", folder, args, deadline - time.monotonic())
                if task == "train":
                    rec["speedup"] = ratio(rec, "step_ms", larger_is_better=False)
                    # nybble's peak as a fraction of bitsandbytes'
                    inverse = ratio(rec, "peak_reserved", larger_is_better=False)
                    rec["memory_vs_bnb"] = None if inverse is None else round(1 / inverse, 3)
                else:
                    rec["speedup"] = ratio(rec, "tokens_per_s", larger_is_better=True)
                print(json.dumps(rec), flush=True)
                records.append(rec)
    config = dict(
        r=R,
        alpha=2 * R,
        double_quant=args.double_quant,
        compute_dtype="bfloat16",
        gradient_checkpointing=True,
        prompt=PROMPT,
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "torch_gpu.json"
    out.write_text(json.dumps({"config": config, "records": records}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
