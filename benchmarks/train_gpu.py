"""QLoRA training on the GPU: nybble's Trainer against transformers + PEFT + bitsandbytes, the
recipe a user would otherwise pick, on the same GPU in the same run.

    python3 benchmarks/train_gpu.py [--cases layer,qwen3-0.6b] [--steps 5] [--out-dir DIR]

Cases (random weights; nybble's weights are saved and loaded by transformers, so both sides
train the same model):
- `layer`: one real-shaped decoder layer (Qwen3-4B's: hidden 2560, intermediate 9728, 32
  heads / 8 KV heads, head_dim 128, q/k norms) in a model with a 256-token vocabulary, so the
  embedding and head cost next to nothing; 1 x 4096 tokens, r=16 on all seven projections,
  NF4 base, bfloat16 compute, no gradient checkpointing.
- `qwen3-0.6b`: the whole Qwen3-0.6B shape (28 layers, vocabulary 151936, tied embeddings),
  1 x 2048 tokens, r=16 all-linear, NF4 base, bfloat16 compute, gradient checkpointing on; and
  the memory estimator's `framework="nybble"` figure against the measured total.

Both sides: plain NF4 (no double quantization), LoRA alpha 32, no dropout, AdamW, float32
adapters. Each side runs in a fresh process (CuPy's pool and torch's allocator never share
one). Time per step: the median of `--steps` steps after two warm-ups, each ending with the
loss on the host (nybble: `train_batch`, which returns it; torch: `loss.item()` after the
optimizer step). Memory, in a pass of its own after the timing: the allocated and reserved
peaks of one steady step (torch: its peak counters; nybble: `_gpu_memory.PoolPeak`), and the
process's total from NVML after it.

`--sides nybble` leaves out transformers (a before/after comparison of nybble alone, run with
each version's package on PYTHONPATH); `--profile` adds where one steady step of nybble's
spends its host time (cProfile, the functions of largest own time; the wait for the GPU shows
as the time of the call that reads the loss) and its kernels' time (torch's profiler, where
torch is installed: the sum, the launches and the kernels of most time), to tell a slower
kernel from a longer wait between kernels.

Writes train_gpu.json (into benchmarks/results/ by default).
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
CASES: dict[str, dict[str, Any]] = {
    "layer": dict(
        model=dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=1,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=256,
            tie_word_embeddings=True,
            qk_norm=True,
            model_type="qwen3",
            rope_theta=1e6,
        ),
        batch=1,
        seq=4096,
        gc=False,
    ),
    "qwen3-0.6b": dict(
        model=dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
            qk_norm=True,
            model_type="qwen3",
            rope_theta=1e6,
        ),
        batch=1,
        seq=2048,
        gc=True,
    ),
}


# --- measured in a worker process -----------------------------------------------------------


def nvml_process_bytes() -> int | None:
    """This process's GPU memory as NVML reports it (CUDA context, kernels and allocators)."""
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


def token_batches(vocab: int, batch: int, seq: int, count: int) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        ids = rng.integers(0, vocab, (batch, seq + 1))
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def nybble_trainer(case: dict[str, Any]) -> Any:
    from nybble import LoraConfig
    from nybble.train import Trainer, TransformerConfig

    return Trainer(
        TransformerConfig(**case["model"]),
        LoraConfig(r=R, alpha=2 * R, target_modules="all-linear"),
        lr=1e-4,
        quant="nf4",
        device="cuda",
        compute_dtype="bfloat16",
        gradient_checkpointing=case["gc"],
    )


def host_profile(run: Any, top: int = 25) -> dict[str, Any]:
    """One call of `run` under cProfile: its wall time and the `top` functions by own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.runcall(run)
    wall = time.perf_counter() - t0
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return dict(
        wall_ms=round(wall * 1e3, 2),
        top=[
            dict(
                function=f"{Path(file).name}:{line}:{name}",
                calls=int(called),
                own_ms=round(own * 1e3, 3),
                cumulative_ms=round(cumulative * 1e3, 3),
            )
            for (file, line, name), (_, called, own, cumulative, _) in rows
        ],
    )


def run_nybble(
    case: dict[str, Any], steps: int, weights_dir: Path, profile: bool = False
) -> dict[str, Any]:
    import cupy
    from _gpu_memory import PoolPeak
    from _timing import kernel_profile

    t0 = time.perf_counter()
    trainer = nybble_trainer(case)
    setup_s = time.perf_counter() - t0
    batches = token_batches(case["model"]["vocab_size"], case["batch"], case["seq"], steps + 3)
    for inputs, targets in batches[:2]:
        trainer.train_batch(inputs, targets)
    times, losses = [], []
    for inputs, targets in batches[2:-1]:
        t0 = time.perf_counter()
        losses.append(trainer.train_batch(inputs, targets))
        times.append(time.perf_counter() - t0)
    with PoolPeak() as peak:
        trainer.train_batch(*batches[-1])
    cupy.cuda.Device().synchronize()
    profiled = host_profile(lambda: trainer.train_batch(*batches[-1])) if profile else None
    rec = dict(
        step_ms=round(statistics.median(times) * 1e3, 2),
        step_ms_all=[round(t * 1e3, 2) for t in times],
        losses=[round(v, 5) for v in losses],
        setup_s=round(setup_s, 2),
        peak_allocated=peak.allocated,
        peak_reserved=peak.reserved,
        nvml_process=nvml_process_bytes(),
        trainable_params=sum(int(v.size) for v in trainer.named_parameters().values()),
    )
    if profiled is not None:
        rec["host_profile"] = profiled
        rec["kernel_profile"] = kernel_profile(lambda: trainer.train_batch(*batches[-1]))
    # transformers loads the same base weights: dequantized, in bfloat16, which bitsandbytes
    # quantizes again on load (to nearly the same codes: bfloat16 rounding aside)
    save_base(trainer.state_dict(), case, weights_dir)
    return rec


def save_base(state: dict[str, Any], case: dict[str, Any], directory: Path) -> None:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from nybble.train import TransformerConfig

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v).astype(ml_dtypes.bfloat16) for k, v in state.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    fields = TransformerConfig(**case["model"]).to_hf()
    fields["torch_dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(fields, indent=2))


def run_torch(case: dict[str, Any], steps: int, weights_dir: Path) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    t0 = time.perf_counter()
    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=False,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(weights_dir), quantization_config=bnb, device_map="cuda", dtype=torch.bfloat16
    )
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=case["gc"])
    lora = LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(model, lora)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0

    def step(inputs: Any, targets: Any) -> float:
        ids = torch.from_numpy(inputs).to("cuda", non_blocking=True)
        labels = torch.from_numpy(targets).to("cuda", non_blocking=True)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    batches = token_batches(case["model"]["vocab_size"], case["batch"], case["seq"], steps + 3)
    for inputs, targets in batches[:2]:
        step(inputs, targets)
    times, losses = [], []
    for inputs, targets in batches[2:-1]:
        t0 = time.perf_counter()
        losses.append(step(inputs, targets))
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(*batches[-1])
    torch.cuda.synchronize()
    return dict(
        step_ms=round(statistics.median(times) * 1e3, 2),
        step_ms_all=[round(t * 1e3, 2) for t in times],
        losses=[round(v, 5) for v in losses],
        setup_s=round(setup_s, 2),
        peak_allocated=torch.cuda.max_memory_allocated(),
        peak_reserved=torch.cuda.max_memory_reserved(),
        nvml_process=nvml_process_bytes(),
        trainable_params=sum(p.numel() for p in params),
        attn_implementation=model.config._attn_implementation,
        versions={
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "peft": __import__("peft").__version__,
            "bitsandbytes": __import__("bitsandbytes").__version__,
        },
    )


def estimate(case: dict[str, Any]) -> dict[str, Any]:
    """The estimator's figure for the nybble side of a case (or why there is none)."""
    from nybble.memory import estimate_memory
    from nybble.train import TransformerConfig

    try:
        est = estimate_memory(
            TransformerConfig(**case["model"]).to_hf(),
            quant="nf4",
            double_quant=False,
            lora_r=R,
            targets="all-linear",
            batch=case["batch"],
            seq_len=case["seq"],
            grad_checkpointing=case["gc"],
            compute_dtype="bfloat16",
            framework="nybble",
        )
    except (KeyError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return dict(
        total=est.total_bytes,
        allocated_peak=est.allocated_peak_bytes,
        reserved_peak=est.reserved_peak_bytes,
        context=est.context_bytes,
    )


def worker(side: str, name: str, steps: int, weights_dir: Path, profile: bool) -> None:
    sys.path.insert(0, str(HERE))
    case = CASES[name]
    if side == "nybble":
        rec = run_nybble(case, steps, weights_dir, profile)
    else:
        rec = run_torch(case, steps, weights_dir)
    print("RESULT " + json.dumps(rec), flush=True)


# --- the parent: never touches the GPU --------------------------------------------------------


def spawn(
    side: str, name: str, steps: int, weights_dir: Path, timeout: float, profile: bool = False
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", side, "--cases", name, "--steps", str(steps)]
    cmd += ["--weights-dir", str(weights_dir)] + (["--profile"] if profile else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    return {"error": f"exit {p.returncode}: {p.stderr.strip()[-1500:]}"}


def compare(
    name: str, steps: int, deadline: float, torch_side: bool = True, profile: bool = False
) -> dict[str, Any]:
    case = CASES[name]
    rec: dict[str, Any] = {"case": name, **case, "r": R, "tokens": case["batch"] * case["seq"]}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        left = max(30.0, deadline - time.monotonic())
        rec["nybble"] = spawn("nybble", name, steps, Path(d), left * 0.6, profile)
        if torch_side and "error" not in rec["nybble"]:
            left = max(30.0, deadline - time.monotonic())
            rec["torch_peft_bnb"] = spawn("torch", name, steps, Path(d), left)
    ours, theirs = rec["nybble"], rec.get("torch_peft_bnb", {})
    if "step_ms" in ours and "step_ms" in theirs:
        rec["speedup"] = round(theirs["step_ms"] / ours["step_ms"], 3)
        rec["tokens_per_s"] = {
            "nybble": round(rec["tokens"] / ours["step_ms"] * 1e3),
            "torch_peft_bnb": round(rec["tokens"] / theirs["step_ms"] * 1e3),
        }
        for k in ("peak_allocated", "peak_reserved", "nvml_process"):
            if ours.get(k) and theirs.get(k):
                rec[f"{k}_ratio"] = round(ours[k] / theirs[k], 3)
    if name == "qwen3-0.6b":
        est = estimate(case)
        rec["estimate_nybble"] = est
        if "total" in est and ours.get("nvml_process"):
            rec["estimate_error"] = round(est["total"] / ours["nvml_process"] - 1, 4)
    print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--deadline-s", type=float, default=540.0)
    parser.add_argument("--sides", default="nybble,torch", help="nybble alone, or both")
    parser.add_argument("--profile", action="store_true", help="nybble's host time of a step")
    parser.add_argument("--worker", choices=["nybble", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--weights-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    sides = args.sides.split(",")
    if "nybble" not in sides or not set(sides) <= {"nybble", "torch"}:
        parser.error(f"--sides: nybble or nybble,torch, got {args.sides!r}")
    if args.worker:
        worker(args.worker, names[0], args.steps, args.weights_dir, args.profile)
        return
    deadline = time.monotonic() + args.deadline_s
    records = [compare(n, args.steps, deadline, "torch" in sides, args.profile) for n in names]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "train_gpu.json"
    out.write_text(json.dumps({"records": records}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
