"""nybble inside transformers + PEFT against bitsandbytes on the GPU, as a QLoRA user runs
them: the same `from_pretrained` / `get_peft_model` / training step / `Trainer` / `generate`,
with `quantization_config=nybble.torch.NybbleConfig(...)` on one side and
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", ...)` on the other, on the
same checkpoint and GPU in the same run.

    python3 benchmarks/torch_gpu.py [--models llama-3.1-8b,qwen3-4b] [--layers 4]
        [--parts train,trainer,curve,generate,compile] [--seq 2048] [--steps 4]
        [--new-tokens 128] [--sides nybble,bnb] [--deadline-s 560] [--out-dir DIR]
        [--checkpoint-dir DIR]   # keep the random checkpoints there for the next call
    python3 benchmarks/torch_gpu.py --device cpu --tiny --sides nybble   # the CPU smoke run

Models: the Llama-3.1-8B and Qwen3-4B shapes (hidden, heads, head_dim, intermediate,
vocabulary, rope, Qwen3's q/k norms and tied embeddings) with `--layers` decoder layers (the
whole embedding and head), random weights written once as a bf16 checkpoint folder that
every side loads (`--tiny`: the same architectures at hidden 64, vocabulary 512, for a smoke
run on the CPU). Every side and part runs in a fresh process; one that fails or runs out of
time records its error (and what it measured before) and the rest goes on.

The LoRA model, in every training part: batch 1 of `--seq` tokens, LoRA r=16 alpha 32 on all
seven projections (`target_modules="all-linear"`), no dropout, NF4 with double quantization,
bf16 compute, `prepare_model_for_kbit_training`, gradient checkpointing (use_reentrant=False,
the same call on both sides), torch AdamW, the loss from `labels`. The adapters' A matrices
are drawn from a generator seeded by each parameter's name (PEFT's kaiming-uniform bound,
1/sqrt(in)) and B is zero, so both sides start from the same adapter.

Parts (`--parts`, comma-separated; `compile` is `compile-generate,compile-train`):
- `train`: a plain loop, a new random batch each step; the median of `--steps` steps after
  two warm-ups, and the peak memory of one steady step (torch's reserved and allocated peaks,
  plus the process's memory outside the allocator from NVML where pynvml is present).
- `trainer`: the same model under `transformers.Trainer` (an in-memory dataset of random
  sequences, batch 1, bf16, gradient checkpointing use_reentrant=False, no eval, no saving,
  report_to=[]); the median step (a TrainerCallback, on_step_begin to on_step_end, with the
  device synchronized) after two warm-ups, and the peak memory of the steady steps.
- `curve`: `--curve-steps` (20) steps of the plain loop on one fixed batch at lr 1e-3, the
  same data and adapter on both sides; the losses, and the largest relative difference
  between the sides (target <= 1%).
- `generate`: the quantized model without an adapter, greedy, batch 1, a 32-token prompt,
  `--new-tokens` new tokens (no stop token), tokens per second of the decode steps (the
  n-token call less an 8-token call), the prefill time (a 1-token call), and the first
  generated ids of each side.
- `compile-generate`: `generate` eager, then with transformers' own compiled decoding
  (`generation_config.cache_implementation="static"`, `compile_config=CompileConfig(mode=
  --generate-compile-mode)`: the prefill eager, each decode step a compiled call), on both
  sides alike: transformers compiles only for quantizers it marks compileable, which
  bitsandbytes' is not, so its check is answered yes on both; tokens per second of each, the
  compile time (the first compiled call) and whether the ids agree. (Compiling
  `model.forward` by hand puts the static cache's first allocation inside a CUDA graph, whose
  next replay overwrites it: both sides fail that way.)
- `compile-train`: the plain-loop step eager, then with `torch.compile(model)` (mode
  `--train-compile-mode`), the same data; the median step of each, the compile time, peaks.
- `profile`: where a step's time goes: the plain-loop step under bf16 autocast (as the
  `Trainer` runs it), the median of `--steps` steps after two warm-ups, then one step under
  torch's profiler: its total self time on the host and on the GPU, and the operators and
  kernels that take the most of each.

Writes torch_gpu.json (into benchmarks/results/ by default; records of other models and
parts already in the file are kept) after each part, and prints a table of nybble/bnb ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from _shapes import shapes, write_checkpoint

HERE = Path(__file__).parent
RESULTS = HERE / "results"
R = 16
PROMPT = 32
WARMUP = 2
TRAIN_LR = 1e-4
CURVE_LR = 1e-3
PARTS = ("train", "trainer", "curve", "generate", "compile-generate", "compile-train", "profile")
ALIASES = {"compile": ("compile-generate", "compile-train")}

MODELS = shapes("llama-3.1-8b", "qwen3-4b")
TINY = dict(
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)


def model_fields(name: str, layers: int, tiny: bool) -> dict[str, Any]:
    fields = dict(MODELS[name], num_hidden_layers=layers, torch_dtype="bfloat16")
    return dict(fields, **TINY) if tiny else fields


def checkpoint_bytes(fields: dict[str, Any]) -> int:
    """The bf16 checkpoint's size, near enough (the norms left out)."""
    h, i, d = fields["hidden_size"], fields["intermediate_size"], fields["head_dim"]
    heads, kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    embeddings = fields["vocab_size"] * h * (1 if fields["tie_word_embeddings"] else 2)
    layer = 2 * h * heads * d + 2 * h * kv * d + 3 * h * i
    return 2 * (embeddings + fields["num_hidden_layers"] * layer)


def scratch_dir(need: int) -> str | None:
    """/dev/shm where it has room (containers often give it 64 MB), else the default."""
    try:
        if shutil.disk_usage("/dev/shm").free > 2 * need:
            return "/dev/shm"
    except OSError:
        pass
    return None


# --- the device: everything CUDA-only is here, each call a no-op on the CPU ----------------------


class Device:
    def __init__(self, kind: str) -> None:
        import torch

        self.torch = torch
        self.kind = kind
        self.cuda = kind == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def peaks(self) -> dict[str, Any]:
        """Torch's reserved and allocated peaks since reset_peak (nothing on the CPU)."""
        if not self.cuda:
            return {}
        self.torch.cuda.synchronize()
        return dict(
            peak_reserved=self.torch.cuda.max_memory_reserved(),
            peak_allocated=self.torch.cuda.max_memory_allocated(),
        )

    def outside_allocator(self) -> int | None:
        """The process's GPU memory (NVML) less torch's reserved pool; None without pynvml."""
        if not self.cuda:
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.torch.cuda.current_device())
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == os.getpid():
                    return int(p.usedGpuMemory) - self.torch.cuda.memory_reserved()
        except Exception:  # NVML is optional: the figure is then absent
            return None
        return None

    def name(self) -> str:
        if self.cuda:
            return str(self.torch.cuda.get_device_name())
        return platform.processor() or platform.machine()


def timed(dev: Device, fn: Any) -> tuple[float, Any]:
    dev.sync()
    t0 = time.perf_counter()
    out = fn()
    dev.sync()
    return time.perf_counter() - t0, out


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


# --- workers (one side, one part, one process) --------------------------------------------------


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


def load(side: str, args: argparse.Namespace, dev: Device) -> tuple[Any, dict[str, Any]]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(args.folder),
        quantization_config=quantization_config(side, args.double_quant),
        device_map=dev.kind,
        **{dtype_key: torch.bfloat16},
    )
    dev.sync()
    return model, dict(
        load_s=round(time.perf_counter() - t0, 1), quantized_layers=layer_count(model, side)
    )


def layer_count(model: Any, side: str) -> int:
    """The quantized projections of the side's kind (a check that the side is what it says)."""
    if side == "nybble":
        import nybble.torch

        kind: Any = nybble.torch.Linear4bit
    else:
        import bitsandbytes as bnb

        kind = bnb.nn.Linear4bit
    return sum(1 for m in model.modules() if isinstance(m, kind))


def init_adapters(model: Any) -> None:
    """A from a generator seeded by the parameter's name (PEFT's bound 1/sqrt(in)), B zero:
    the same adapter on both sides, whatever else drew from torch's global generator."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                bound = 1.0 / math.sqrt(p.shape[1])
                values = torch.rand(p.shape, generator=g, dtype=torch.float32) * 2 - 1
                p.copy_((values * bound).to(p.dtype))
            elif ".lora_B." in name:
                p.zero_()


def lora_model(side: str, args: argparse.Namespace, dev: Device) -> tuple[Any, dict[str, Any]]:
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model, info = load(side, args, dev)
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
    torch.manual_seed(0)
    model = get_peft_model(model, lora)
    init_adapters(model)
    model.train()
    info["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, info


def batches(vocab: int, seq: int, seed: int, device: str) -> Any:
    """An endless stream of random (1, seq) batches, the same on every side."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab, (1, seq), generator=generator).to(device)


def loop_step(model: Any, opt: Any, ids: Any) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def optimizer(model: Any, lr: float) -> Any:
    import torch

    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


def time_steps(
    dev: Device, run: Any, opt: Any, data: Any, steps: int
) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for _ in range(steps):
        dt, loss = timed(dev, lambda: loop_step(run, opt, next(data)))
        times.append(dt)
        losses.append(loss)
    return times, losses


def step_record(times: list[float], losses: list[float], seq: int) -> dict[str, Any]:
    median = statistics.median(times)
    return dict(
        step_ms=ms(median),
        tokens_per_s=round(seq / median, 1),
        steps_ms=[ms(t) for t in times],
        losses=[round(v, 5) for v in losses],
    )


def part_train(side: str, args: argparse.Namespace, dev: Device) -> dict[str, Any]:
    model, rec = lora_model(side, args, dev)
    opt = optimizer(model, TRAIN_LR)
    data = batches(model.config.vocab_size, args.seq, 1, dev.kind)
    time_steps(dev, model, opt, data, WARMUP)
    rec.update(step_record(*time_steps(dev, model, opt, data, args.steps), args.seq))
    dev.reset_peak()
    loop_step(model, opt, next(data))
    rec.update(dev.peaks())
    outside = dev.outside_allocator()
    if outside is not None:
        rec["outside_allocator"] = outside
        rec["total"] = rec["peak_reserved"] + max(outside, 0)
    return rec


def part_trainer(side: str, args: argparse.Namespace, dev: Device) -> dict[str, Any]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model, rec = lora_model(side, args, dev)
    vocab = model.config.vocab_size
    steps = WARMUP + args.steps
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (steps, args.seq), generator=generator)

    class Sequences(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return steps

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": ids[i], "labels": ids[i]}

    class Timer(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            dev.sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            dev.sync()
            self.times.append(time.perf_counter() - self.t0)
            if len(self.times) == WARMUP:
                dev.reset_peak()

    timer = Timer()
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=1,
            max_steps=steps,
            learning_rate=TRAIN_LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            optim="adamw_torch",
            bf16=True,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
            dataloader_pin_memory=dev.cuda,
            remove_unused_columns=False,
            label_names=["labels"],
            use_cpu=not dev.cuda,
            seed=0,
        )
        trainer = Trainer(model=model, args=targs, train_dataset=Sequences(), callbacks=[timer])
        out_ = trainer.train()
    steady = timer.times[WARMUP:]
    rec.update(
        step_ms=ms(statistics.median(steady)),
        tokens_per_s=round(args.seq / statistics.median(steady), 1),
        steps_ms=[ms(t) for t in timer.times],
        training_loss=round(float(out_.training_loss), 5),
        **dev.peaks(),
    )
    return rec


def part_curve(side: str, args: argparse.Namespace, dev: Device) -> dict[str, Any]:
    import torch

    model, rec = lora_model(side, args, dev)
    opt = optimizer(model, CURVE_LR)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), generator=generator)
    ids = ids.to(dev.kind)
    losses = [loop_step(model, opt, ids) for _ in range(args.curve_steps)]
    rec["losses"] = [float(f"{v:.7g}") for v in losses]
    return rec


def dynamo_counts() -> dict[str, int]:
    """Graph breaks and graphs compiled so far in this process (torch's dynamo counters)."""
    try:
        from torch._dynamo.utils import counters

        return dict(
            graph_breaks=sum(counters["graph_break"].values()),
            graphs=int(counters["stats"]["unique_graphs"]),
        )
    except Exception:  # the counters are torch internals: absent, the figures are
        return {}


def generation(model: Any, dev: Device, new_tokens: int, runs: int = 3) -> dict[str, Any]:
    """Greedy batch-1 generate. Decode tokens/s: the n-token call less a short call (8 tokens
    at most), so that what every call pays once (the prefill, setting up the cache, a CUDA
    graph's warm-up and recording) cancels; prefill_ms: a 1-token call."""
    import torch

    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=generator)
    ids = ids.to(dev.kind)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def call(n: int) -> tuple[float, Any]:
        with torch.no_grad():
            return timed(
                dev, lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
            )

    short = max(1, min(8, new_tokens // 2))

    def run(n: int) -> tuple[float, float, list[int]]:
        first, _ = call(1)
        base, _ = call(short)
        total, out = call(n)
        return (n - short) / max(total - base, 1e-9), first, out[0, PROMPT:].tolist()

    # warm-up at the full length: kernels compiled and prepared, pools filled, a static
    # cache sized for the longest call (so the timed calls reuse its shape)
    warm, _ = call(new_tokens)
    results = [run(new_tokens) for _ in range(runs)]
    return dict(
        tokens_per_s=round(statistics.median(r[0] for r in results), 1),
        new_tokens=new_tokens,
        prefill_ms=ms(statistics.median(r[1] for r in results)),
        first_call_s=round(warm, 2),
        ids=results[-1][2][:16],
    )


def part_generate(side: str, args: argparse.Namespace, dev: Device) -> dict[str, Any]:
    model, rec = load(side, args, dev)
    model.eval()
    rec.update(generation(model, dev, args.new_tokens))
    return rec


def part_compile_generate(side: str, args: argparse.Namespace, dev: Device) -> dict[str, Any]:
    model, rec = load(side, args, dev)
    model.eval()
    hf_quantizer = getattr(model, "hf_quantizer", None)
    rec["hf_auto_compile"] = bool(getattr(hf_quantizer, "is_compileable", False))
    eager = generation(model, dev, args.new_tokens)
    rec["eager"] = eager
    partial(rec)
    try:
        from transformers.generation import CompileConfig

        config = model.generation_config
        config.cache_implementation = "static"
        config.compile_config = CompileConfig(mode=args.generate_compile_mode)
        # the same route on both sides, whatever the quantizer says of itself
        model._valid_auto_compile_criteria = lambda *_: True
        compiled = generation(model, dev, args.new_tokens)
    except Exception as e:  # the eager figures stay; the compile's failure is the record
        rec["error"] = f"compile: {type(e).__name__}: {str(e)[-1500:]}"
        return rec
    rec["compiled"] = compiled
    rec.update(dynamo_counts())
    rec["compile_s"] = compiled["first_call_s"]
    rec["tokens_per_s"] = compiled["tokens_per_s"]
    rec["speedup_vs_eager"] = round(compiled["tokens_per_s"] / eager["tokens_per_s"], 2)
    rec["ids_match_eager"] = compiled["ids"] == eager["ids"]
    return rec


def part_compile_train(side: str, args: argparse.Namespace, dev: Device) -> dict[str, Any]:
    import torch

    model, rec = lora_model(side, args, dev)
    opt = optimizer(model, TRAIN_LR)
    data = batches(model.config.vocab_size, args.seq, 1, dev.kind)
    time_steps(dev, model, opt, data, WARMUP)
    rec["eager"] = step_record(*time_steps(dev, model, opt, data, args.steps), args.seq)
    dev.reset_peak()
    loop_step(model, opt, next(data))
    rec["eager"].update(dev.peaks())
    partial(rec)
    try:
        compiled = torch.compile(model, mode=args.train_compile_mode)
        warm, _ = time_steps(dev, compiled, opt, data, WARMUP)
        steady = step_record(*time_steps(dev, compiled, opt, data, args.steps), args.seq)
        dev.reset_peak()
        loop_step(compiled, opt, next(data))
        steady.update(dev.peaks())
    except Exception as e:  # the eager figures stay; the compile's failure is the record
        rec["error"] = f"compile: {type(e).__name__}: {str(e)[-1500:]}"
        return rec
    rec["compiled"] = steady
    rec.update(dynamo_counts())
    rec["compile_s"] = round(warm[0], 2)
    rec["step_ms"] = steady["step_ms"]
    rec["speedup_vs_eager"] = round(rec["eager"]["step_ms"] / steady["step_ms"], 2)
    return rec


def part_profile(side: str, args: argparse.Namespace, dev: Device) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    model, rec = lora_model(side, args, dev)
    opt = optimizer(model, TRAIN_LR)
    data = batches(model.config.vocab_size, args.seq, 1, dev.kind)

    def step() -> float:
        with torch.autocast(dev.kind, dtype=torch.bfloat16):
            ids = next(data)
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    times = [timed(dev, step)[0] for _ in range(WARMUP + args.steps)][WARMUP:]
    rec.update(step_ms=ms(statistics.median(times)), steps_ms=[ms(t) for t in times])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
    with profile(activities=activities) as prof:
        step()
        dev.sync()
    events = prof.key_averages()

    def top(key: str, n: int) -> list[dict[str, Any]]:
        ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
        return [
            dict(name=e.key[:90], self_us=round(getattr(e, key), 1), calls=e.count)
            for e in ranked
            if getattr(e, key) > 0
        ]

    gpu_key = "self_device_time_total"
    rec.update(
        profiled_host_ms=round(sum(e.self_cpu_time_total for e in events) / 1e3, 2),
        top_host=top("self_cpu_time_total", 12),
    )
    if dev.cuda:
        rec.update(
            profiled_gpu_ms=round(sum(getattr(e, gpu_key) for e in events) / 1e3, 2),
            top_gpu=top(gpu_key, 10),
        )
    return rec


WORKERS = {
    "train": part_train,
    "trainer": part_trainer,
    "curve": part_curve,
    "generate": part_generate,
    "compile-generate": part_compile_generate,
    "compile-train": part_compile_train,
    "profile": part_profile,
}


def partial(rec: dict[str, Any]) -> None:
    """What a part has so far, for the parent to keep if the rest times out or crashes."""
    print("PARTIAL " + json.dumps(rec), flush=True)


def worker(args: argparse.Namespace) -> None:
    import torch

    side, part = args.worker.split(":")
    torch.manual_seed(0)
    dev = Device(args.device)
    rec = WORKERS[part](side, args, dev)
    rec["device"] = dev.name()
    rec["versions"] = versions(side)
    print("RESULT " + json.dumps(rec), flush=True)


def versions(side: str) -> dict[str, str]:
    import peft
    import torch
    import transformers

    out = dict(torch=torch.__version__, transformers=transformers.__version__)
    out["peft"] = peft.__version__
    if side == "bnb":
        import bitsandbytes

        out["bitsandbytes"] = bitsandbytes.__version__
    return out


# --- the parent: never touches the GPU ---------------------------------------------------------


def last_line(text: str | None, prefix: str) -> dict[str, Any] | None:
    found = None
    for line in (text or "").splitlines():
        if line.startswith(prefix):
            found = dict(json.loads(line[len(prefix) :]))
    return found


def spawn(job: str, folder: Path, args: argparse.Namespace, left: float) -> dict[str, Any]:
    if left < args.min_part_s:
        return {"error": f"skipped: {left:.0f} s left before the deadline"}
    cmd = [sys.executable, __file__, "--worker", job, "--folder", str(folder)]
    cmd += ["--device", args.device, "--seq", str(args.seq), "--steps", str(args.steps)]
    cmd += ["--new-tokens", str(args.new_tokens), "--curve-steps", str(args.curve_steps)]
    cmd += ["--generate-compile-mode", args.generate_compile_mode]
    cmd += ["--train-compile-mode", args.train_compile_mode]
    cmd += ["--double-quant" if args.double_quant else "--no-double-quant"]
    t0 = time.monotonic()
    # a session of its own, so that a timeout ends the worker and its compile workers together
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = p.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, _ = p.communicate()
        rec = last_line(stdout, "PARTIAL ") or {}
        return dict(rec, error=f"timed out after {left:.0f} s", wall_s=round(left, 1))
    wall = round(time.monotonic() - t0, 1)
    rec = last_line(stdout, "RESULT ")
    if rec is not None:
        return dict(rec, wall_s=wall)
    rec = last_line(stdout, "PARTIAL ") or {}
    return dict(rec, error=f"exit {p.returncode}: {stderr.strip()[-1500:]}", wall_s=wall)


def compare(rec: dict[str, Any]) -> None:
    """The cross-side figures of one part's record, from the sides' own."""
    ours, theirs = rec.get("nybble", {}), rec.get("bnb", {})

    def ratio(key: str, a: dict[str, Any] = ours, b: dict[str, Any] = theirs) -> float | None:
        x, y = a.get(key), b.get(key)
        return round(x / y, 3) if x and y else None

    part = rec["part"]
    if part == "profile":
        rec["step_nybble_over_bnb"] = ratio("step_ms")
        rec["gpu_nybble_over_bnb"] = ratio("profiled_gpu_ms")
    elif part in ("train", "trainer", "compile-train"):
        rec["step_nybble_over_bnb"] = ratio("step_ms")
        rec["memory_nybble_over_bnb"] = ratio("peak_reserved")
        if part == "compile-train":
            rec["memory_nybble_over_bnb"] = ratio(
                "peak_reserved", ours.get("compiled", {}), theirs.get("compiled", {})
            )
    elif part in ("generate", "compile-generate"):
        rec["tokens_per_s_nybble_over_bnb"] = ratio("tokens_per_s")
        if ours.get("ids") is not None and theirs.get("ids") is not None:
            rec["ids_match"] = ours["ids"] == theirs["ids"]
    elif part == "curve":
        a, b = ours.get("losses"), theirs.get("losses")
        if a and b and len(a) == len(b):
            diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
            rec["max_abs_diff"] = float(f"{max(diffs):.4g}")
            rec["max_rel_diff"] = float(
                f"{max(d / abs(y) for d, y in zip(diffs, b, strict=True)):.4g}"
            )
            rec["within_1_percent"] = rec["max_rel_diff"] <= 0.01


def summary(records: list[dict[str, Any]]) -> str:
    rows = [("model", "part", "figure", "nybble", "bnb", "nybble/bnb")]
    errors: list[str] = []

    def num(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    def row(rec: dict[str, Any], figure: str, get: Any) -> None:
        a, b = get(rec.get("nybble", {})), get(rec.get("bnb", {}))
        r = (
            round(a / b, 3)
            if isinstance(a, int | float) and isinstance(b, int | float) and b
            else None
        )
        rows.append((rec["model"], rec["part"], figure, num(a), num(b), num(r)))

    def gib(key: str, sub: str | None = None) -> Any:
        def get(side: dict[str, Any]) -> Any:
            v = (side.get(sub, {}) if sub else side).get(key)
            return None if v is None else round(v / 2**30, 2)

        return get

    for rec in records:
        part = rec["part"]
        if part in ("train", "trainer"):
            row(rec, "step ms", lambda s: s.get("step_ms"))
            row(rec, "peak reserved GiB", gib("peak_reserved"))
        elif part == "profile":
            row(rec, "autocast step ms", lambda s: s.get("step_ms"))
            row(rec, "profiled host ms", lambda s: s.get("profiled_host_ms"))
            row(rec, "profiled GPU ms", lambda s: s.get("profiled_gpu_ms"))
        elif part == "curve":
            row(rec, "first loss", lambda s: (s.get("losses") or [None])[0])
            row(rec, "last loss", lambda s: (s.get("losses") or [None])[-1])
            rows.append(
                (rec["model"], part, "max rel diff (<= 0.01)", "", "", num(rec.get("max_rel_diff")))
            )
        elif part == "generate":
            row(rec, "tokens/s", lambda s: s.get("tokens_per_s"))
        elif part == "compile-generate":
            row(rec, "eager tokens/s", lambda s: s.get("eager", {}).get("tokens_per_s"))
            row(rec, "compiled tokens/s", lambda s: s.get("compiled", {}).get("tokens_per_s"))
            row(rec, "compiled/eager", lambda s: s.get("speedup_vs_eager"))
            row(rec, "compile s", lambda s: s.get("compile_s"))
        elif part == "compile-train":
            row(rec, "eager step ms", lambda s: s.get("eager", {}).get("step_ms"))
            row(rec, "compiled step ms", lambda s: s.get("compiled", {}).get("step_ms"))
            row(rec, "eager/compiled", lambda s: s.get("speedup_vs_eager"))
            row(rec, "compiled peak GiB", gib("peak_reserved", "compiled"))
            row(rec, "compile s", lambda s: s.get("compile_s"))
        for side in ("nybble", "bnb"):
            err = (rec.get(side, {}).get("error") or "").strip()
            if err:
                errors.append(f"{rec['model']} {part} {side}: {err.splitlines()[-1][:200]}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines + [f"error: {e}" for e in errors])


def save(out: Path, config: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Writes the records, keeping those of other models and parts already in the file."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r.get("model"), r.get("layers"), r.get("tiny", False), r.get("part"))

    kept: list[dict[str, Any]] = []
    if out.exists():
        try:
            kept = list(json.loads(out.read_text()).get("records", []))
        except (ValueError, AttributeError):
            kept = []
    ours = {key(r) for r in records}
    merged = [r for r in kept if key(r) not in ours] + records
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"config": config, "records": merged}, indent=2) + "\n")
    tmp.replace(out)


def parse_parts(text: str) -> list[str]:
    parts: list[str] = []
    for p in (p.strip() for p in text.split(",")):
        for q in ALIASES.get(p, (p,)):
            if q and q not in parts:
                parts.append(q)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Needs a CUDA GPU with torch, transformers, peft, CuPy and nybble[torch]; "
        "bitsandbytes for the bnb side. --device cpu --tiny runs every part on the CPU.",
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: %(default)s")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument(
        "--parts",
        default="train,trainer,curve,generate,compile",
        help=f"comma-separated, from {','.join(PARTS)}; compile = compile-generate,"
        "compile-train (default: all)",
    )
    parser.add_argument("--seq", type=int, help="tokens per training step (2048; --tiny 64)")
    parser.add_argument("--steps", type=int, default=4, help="timed training steps")
    parser.add_argument("--curve-steps", type=int, default=20, help="steps of the loss curve")
    parser.add_argument("--new-tokens", type=int, help="tokens generated (128; --tiny 16)")
    parser.add_argument("--sides", default="nybble,bnb", help="comma-separated: %(default)s")
    parser.add_argument(
        "--double-quant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="double-quantized scales on both sides (default on, the QLoRA recipe)",
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="hidden 64, vocabulary 512 shapes")
    parser.add_argument("--generate-compile-mode", default="reduce-overhead")
    parser.add_argument("--train-compile-mode", default="default")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="keep the random checkpoints here and reuse them (default: a temporary folder)",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--deadline-s", type=float, default=560.0, help="for all the runs")
    parser.add_argument(
        "--min-part-s", type=float, default=20.0, help="a part is not started with less left"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seq is None:
        args.seq = 64 if args.tiny else 2048
    if args.new_tokens is None:
        args.new_tokens = 16 if args.tiny else 128
    if args.worker:
        worker(args)
        return
    deadline = time.monotonic() + args.deadline_s
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        parser.error(f"unknown model(s) {', '.join(sorted(unknown))}; known: {', '.join(MODELS)}")
    sides = [s for s in args.sides.split(",") if s]
    if set(sides) - {"nybble", "bnb"}:
        parser.error("--sides takes nybble and bnb")
    parts = parse_parts(args.parts)
    if set(parts) - set(PARTS):
        parser.error(f"unknown part(s) {', '.join(sorted(set(parts) - set(PARTS)))}")
    config = dict(
        r=R,
        alpha=2 * R,
        double_quant=args.double_quant,
        compute_dtype="bfloat16",
        gradient_checkpointing=True,
        prompt=PROMPT,
        warmup_steps=WARMUP,
        train_lr=TRAIN_LR,
        curve_lr=CURVE_LR,
        curve_steps=args.curve_steps,
        generate_compile_mode=args.generate_compile_mode,
        train_compile_mode=args.train_compile_mode,
    )
    out = args.out_dir / "torch_gpu.json"
    records: list[dict[str, Any]] = []
    for name in models:
        fields = model_fields(name, args.layers, args.tiny)
        tag = f"{name}-{args.layers}l" + ("-tiny" if args.tiny else "")
        temp = None
        if args.checkpoint_dir is not None:
            folder = args.checkpoint_dir / tag
        else:
            temp = tempfile.mkdtemp(dir=scratch_dir(checkpoint_bytes(fields)))
            folder = Path(temp) / tag
        try:
            have = folder / "config.json"
            if not (have.exists() and json.loads(have.read_text()) == fields):
                t0 = time.monotonic()
                write_checkpoint(fields, folder)
                print(f"{tag}: checkpoint written in {time.monotonic() - t0:.1f} s", flush=True)
            for part in parts:
                rec: dict[str, Any] = {"model": name, "layers": args.layers, "part": part}
                if args.tiny:
                    rec["tiny"] = True
                if part in ("generate", "compile-generate"):
                    rec["new_tokens"] = args.new_tokens
                else:
                    rec["seq"] = args.seq
                for side in sides:
                    left = deadline - time.monotonic() - 5.0  # time for the parent to write
                    rec[side] = spawn(f"{side}:{part}", folder, args, left)
                compare(rec)
                print(json.dumps(rec), flush=True)
                records.append(rec)
                save(out, config, records)
        finally:
            if temp is not None:
                shutil.rmtree(temp, ignore_errors=True)
    save(out, config, records)
    print(summary(records))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
