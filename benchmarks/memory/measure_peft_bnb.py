"""Measure peak GPU memory of transformers + PEFT + bitsandbytes QLoRA training steps.

The recipe is SPEC §5's: `BitsAndBytesConfig(load_in_4bit, nf4, double quant, bf16 compute)`,
`prepare_model_for_kbit_training`, `get_peft_model` (r=16, alpha 32, dropout 0, all-linear),
`model.train()`, torch AdamW, default (sdpa) attention, loss from `labels`.

Models are built from config dicts with random weights (no downloads): a bf16 safetensors
checkpoint is written once per architecture (to /dev/shm when it has room) and loaded with
`from_pretrained(..., quantization_config=...)`, the path a user takes, so the module structure,
the load-time allocations and PEFT's fp32 up-cast are the real ones. A config can load fewer
layers than the checkpoint holds (`num_hidden_layers` override), which is how the 7-8B
architectures are measured at reduced depth.

Each configuration runs in its own process (forked from a parent that imported torch,
transformers and peft but never touched CUDA), so every figure is a fresh process's:
- `context_bytes`: the process's memory in NVML right after CUDA initialisation, before any
  tensor (SPEC §5);
- per phase: `torch.cuda.memory_allocated/reserved` after load, prepare, get_peft_model;
- per step: `max_memory_allocated/reserved` with the peak counters reset before the step;
  step 1 creates the optimizer states, step 2 is the measured steady-state step (step 3 is
  kept as a check that step 2 was steady).
The measured figure to compare with `estimate_memory(...).total_bytes` is
`step2.peak_reserved + context_bytes`; `step2.peak_allocated` is the allocated peak.

Several configurations run at once (each in its own process; the torch statistics are per
process), admitted under a GPU memory budget from a deliberately generous rough estimate.
Every finished configuration is appended to `OUT/measured.jsonl` at once, so a run cut short
still leaves its results. Run on the GPU machine:

    PYTHONUNBUFFERED=1 python3 benchmarks/memory/measure_peft_bnb.py --out $OUT --budget-s 420

`--smoke` runs two tiny configurations on the CPU (no CUDA statistics): a check of the
control flow on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# --- architectures (HF config fields) ---------------------------------------------------

ARCHS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
    "qwen3-4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=32.0,
            high_freq_factor=4.0,
            low_freq_factor=1.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=8.0,
            high_freq_factor=4.0,
            low_freq_factor=1.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
    ),
    "mistral-7b": dict(
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32768,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        sliding_window=None,
    ),
    "llama-2-7b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        rope_theta=10000.0,
    ),
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        vocab_size=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    ),
}

#: Checkpoints to write, smallest first: (architecture, layers). A config loads the first
#: `layers` layers of the smallest checkpoint of its architecture that has enough of them.
CHECKPOINTS = [
    ("tiny", 2),
    ("qwen3-0.6b", 28),
    ("mistral-7b", 8),
    ("llama-3.2-1b", 16),
    ("qwen3-4b", 8),
    ("llama-2-7b", 4),
    ("llama-3.1-8b", 8),
    ("qwen3-4b", 36),
]


def checkpoint_name(arch: str, layers: int) -> str:
    depth = min(n for a, n in CHECKPOINTS if a == arch and n >= layers)
    return f"{arch}-L{depth}"


def config_matrix() -> list[dict[str, Any]]:
    """The configurations, most important first (a run cut short keeps the head of the list)."""
    out: list[dict[str, Any]] = []
    core = [
        ("qwen3-0.6b", 28),
        ("llama-3.2-1b", 16),
        ("qwen3-4b", 4),
        ("llama-3.1-8b", 4),
        ("mistral-7b", 4),
    ]
    grid = [(gc, b, s) for gc in (True, False) for s in (512, 2048) for b in (1, 2)]
    for gc, b, s in grid:
        for arch, layers in core:
            out.append(dict(arch=arch, layers=layers, batch=b, seq=s, gc=gc))
    extra = [
        ("tiny", 2, 1, 128, True),
        ("tiny", 2, 1, 128, False),
        ("qwen3-4b", 36, 1, 2048, True),
        ("qwen3-4b", 36, 1, 4096, True),
        ("qwen3-4b", 8, 1, 2048, True),
        ("qwen3-4b", 8, 1, 2048, False),
        ("llama-3.1-8b", 8, 1, 4096, True),
        ("mistral-7b", 8, 2, 4096, True),
        ("llama-2-7b", 4, 1, 2048, True),
        ("llama-2-7b", 4, 1, 2048, False),
    ]
    for arch, layers, b, s, gc in extra:
        out.append(dict(arch=arch, layers=layers, batch=b, seq=s, gc=gc))
    # Other recipe knobs, on one small model: LoRA dropout, 8-bit AdamW, a larger rank.
    base = dict(arch="qwen3-4b", layers=4, batch=1, seq=2048, gc=True)
    out += [dict(base, dropout=0.05), dict(base, optim="adamw8bit"), dict(base, r=64)]
    return out


#: Configurations whose allocator events are recorded with `--trace` (the allocator model of
#: the estimator is built and checked against them): each kind of peak, GQA and MHA.
TRACE_CONFIGS = [
    dict(arch="tiny", layers=2, batch=1, seq=128, gc=True),
    dict(arch="qwen3-0.6b", layers=28, batch=1, seq=512, gc=True),
    dict(arch="qwen3-0.6b", layers=28, batch=1, seq=2048, gc=False),
    dict(arch="qwen3-4b", layers=4, batch=1, seq=2048, gc=True),
    dict(arch="qwen3-4b", layers=4, batch=2, seq=512, gc=False),
    dict(arch="llama-3.1-8b", layers=4, batch=1, seq=2048, gc=False),
    dict(arch="mistral-7b", layers=4, batch=1, seq=2048, gc=False),
    dict(arch="llama-2-7b", layers=4, batch=1, seq=2048, gc=True),
    # where the first estimates from the simulation were furthest off
    dict(arch="qwen3-4b", layers=4, batch=2, seq=512, gc=True),
    dict(arch="qwen3-4b", layers=4, batch=1, seq=2048, gc=False),
    dict(arch="llama-3.1-8b", layers=4, batch=1, seq=2048, gc=True),
    dict(arch="llama-3.1-8b", layers=8, batch=1, seq=4096, gc=True),
    dict(arch="mistral-7b", layers=4, batch=1, seq=2048, gc=True),
    dict(arch="mistral-7b", layers=8, batch=2, seq=4096, gc=True),
    dict(arch="llama-2-7b", layers=4, batch=1, seq=2048, gc=False),
    dict(arch="llama-3.2-1b", layers=16, batch=2, seq=512, gc=False),
]
#: Configurations kept out of the estimator's construction (`--holdout`): measured only after
#: its allocation model was settled, to check it on sequence lengths, batch sizes, depths and
#: recipe knobs it was not built from.
HOLDOUT_CONFIGS = [
    dict(arch="qwen3-0.6b", layers=28, batch=3, seq=1024, gc=True),
    dict(arch="qwen3-0.6b", layers=28, batch=1, seq=1536, gc=False),
    dict(arch="llama-3.2-1b", layers=16, batch=1, seq=1024, gc=False),
    dict(arch="llama-3.2-1b", layers=16, batch=4, seq=768, gc=True),
    dict(arch="qwen3-4b", layers=8, batch=2, seq=1024, gc=False),
    dict(arch="qwen3-4b", layers=4, batch=1, seq=3072, gc=True),
    dict(arch="llama-3.1-8b", layers=4, batch=3, seq=1024, gc=True),
    dict(arch="llama-3.1-8b", layers=8, batch=1, seq=1024, gc=False),
    dict(arch="mistral-7b", layers=8, batch=1, seq=3072, gc=False),
    dict(arch="mistral-7b", layers=4, batch=4, seq=512, gc=False),
    dict(arch="llama-2-7b", layers=4, batch=2, seq=1024, gc=False),
    dict(arch="llama-2-7b", layers=4, batch=2, seq=1024, gc=True),
    dict(arch="qwen3-4b", layers=4, batch=1, seq=2048, gc=True, r=8, dropout=0.1),
    dict(arch="qwen3-4b", layers=4, batch=2, seq=1024, gc=False, optim="adamw8bit"),
]
#: Marker allocations in a trace (a size no tensor of the step has; small pool, so they do
#: not disturb the large blocks): MARK + i bytes at the i-th point of MARK_POINTS.
MARK = 777_001
MARK_POINTS = ("after_load", "after_prepare", "after_peft", "step1", "step2", "step2_end")


# --- a rough, deliberately generous estimate used only to admit concurrent runs ----------


def rough_peak_bytes(c: dict[str, Any]) -> float:
    a = ARCHS[c["arch"]]
    h, inter, heads = a["hidden_size"], a["intermediate_size"], a["num_attention_heads"]
    d = a.get("head_dim") or h // heads
    kvd = a["num_key_value_heads"] * d
    qd = heads * d
    v, layers, b, s = a["vocab_size"], c["layers"], c["batch"], c["seq"]
    t = b * s
    lin = layers * (2 * h * qd + 2 * h * kvd + 3 * h * inter)
    static = lin * 0.6 + v * h * 4 * (1 if a["tie_word_embeddings"] else 2) + 1.5e9
    attn = b * heads * s * s * 4
    layer_act = t * 4 * (5 * h + 5 * inter + 6 * qd + 2 * kvd) + attn
    logits = 3 * t * v * 4
    if c["gc"]:
        act = (layers + 1) * t * h * 4 + layer_act + 2 * attn
    else:
        act = layers * layer_act + 2 * attn
    return 1.3 * (static + act + logits) + 2e9


# --- checkpoints -------------------------------------------------------------------------


def hf_config(arch: str, layers: int) -> Any:
    from transformers import AutoConfig

    fields = dict(ARCHS[arch])
    model_type = fields.pop("model_type")
    fields["num_hidden_layers"] = layers
    return AutoConfig.for_model(model_type, **fields)


def write_checkpoint(arch: str, layers: int, root: Path) -> Path:
    """A bf16 checkpoint with random weights (N(0, 0.02) drawn from a shared pool), norms at 1."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = root / f"{arch}-L{layers}"
    if (path / "done").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(arch, layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(1 << 24, generator=gen) * 0.02).to(torch.bfloat16)
    state: dict[str, Any] = {}
    for name, t in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        n = t.numel()
        if t.dim() == 1:
            state[name] = torch.ones(n, dtype=torch.bfloat16)
            continue
        reps = math.ceil(n / pool.numel()) + 1
        off = int(torch.randint(0, pool.numel(), (1,), generator=gen))
        flat = pool.roll(off).repeat(reps)[:n] if reps > 1 else pool.roll(off)[:n]
        state[name] = flat.reshape(t.shape).clone()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(str(path))
    (path / "done").write_text("ok")
    return path


def checkpoint_worker(wanted: list[tuple[str, int]], root: str) -> None:
    for arch, layers in wanted:
        t0 = time.time()
        write_checkpoint(arch, layers, Path(root))
        print(f"[ckpt] {arch}-L{layers} written in {time.time() - t0:.1f}s", flush=True)


# --- one configuration, in its own process -----------------------------------------------


def nvml_process_bytes(pid: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for fn in (
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetComputeRunningProcesses",
        ):
            if hasattr(pynvml, fn):
                for p in getattr(pynvml, fn)(handle):
                    if p.pid == pid and p.usedGpuMemory is not None:
                        return int(p.usedGpuMemory)
                break
        return None
    except Exception:
        return None


def nvml_device_used() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:
        return None


def run_config(c: dict[str, Any], root: str, device: str, result_path: str) -> None:
    t0 = time.time()
    rec: dict[str, Any] = dict(c)
    try:
        rec.update(_measure(c, Path(root), device))
    except Exception as e:  # recorded, never fatal for the run
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rec["traceback"] = traceback.format_exc()[-2000:]
    rec["wall_s"] = round(time.time() - t0, 2)
    line = json.dumps(rec)
    with open(result_path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _measure(c: dict[str, Any], root: Path, device: str) -> dict[str, Any]:
    import torch

    cuda = device == "cuda"
    rec: dict[str, Any] = {}
    pid = os.getpid()
    if cuda:
        used0 = nvml_device_used()
        torch.cuda.init()
        torch.cuda.set_device(0)
        torch.cuda.synchronize()
        rec["context_bytes"] = nvml_process_bytes(pid)
        used1 = nvml_device_used()
        rec["device_used_delta"] = None if used0 is None or used1 is None else used1 - used0

    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    path = root / checkpoint_name(c["arch"], c["layers"])
    cfg = AutoConfig.from_pretrained(str(path))
    cfg.num_hidden_layers = c["layers"]
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[: c["layers"]]

    def mem(tag: str) -> None:
        if cuda:
            torch.cuda.synchronize()
            rec[tag] = dict(
                allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved()
            )
            mark(tag)

    tracing = cuda and bool(c.get("trace"))

    def mark(tag: str) -> None:
        if tracing and tag in MARK_POINTS:
            torch.empty(MARK + MARK_POINTS.index(tag), dtype=torch.uint8, device="cuda")

    if tracing:
        torch.cuda.memory._record_memory_history(
            enabled="all", context="alloc", stacks="python", max_entries=4_000_000
        )

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        config=cfg,
        quantization_config=bnb,
        dtype=torch.bfloat16,
        device_map={"": 0} if cuda else "cpu",
    )
    mem("after_load")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=c["gc"])
    mem("after_prepare")
    r = c.get("r", 16)
    lora = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        lora_dropout=c.get("dropout", 0.0),
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    mem("after_peft")
    model.train()
    rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rec["attn_implementation"] = model.config._attn_implementation
    rec["gc_active"] = bool(getattr(model.base_model.model, "is_gradient_checkpointing", False))
    params = [p for p in model.parameters() if p.requires_grad]
    if c.get("optim", "adamw") == "adamw8bit":
        import bitsandbytes

        opt: Any = bitsandbytes.optim.AdamW8bit(params, lr=1e-4)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4)

    dev = "cuda" if cuda else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (c["batch"], c["seq"]), generator=gen).to(dev)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())

    if cuda:
        h = cfg.num_attention_heads
        kv = cfg.num_key_value_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
        for dt in (torch.float32, torch.bfloat16):
            try:
                q = torch.empty(1, h, 64, d, device="cuda", dtype=dt, requires_grad=True)
                k = torch.empty(1, kv, 64, d, device="cuda", dtype=dt, requires_grad=True)
                choice = int(torch._fused_sdp_choice(q, k, k, None, 0.0, True, None, kv != h))
                rec[f"sdpa_choice_{str(dt)[6:]}"] = SDPA_NAMES.get(choice, str(choice))
                del q, k
            except Exception as e:
                rec[f"sdpa_choice_{str(dt)[6:]}"] = f"probe failed: {e}"

    for step in (1, 2, 3):
        # Step 2 is the measured step: one reset, peaks over forward + backward + optimizer.
        # Step 3 repeats it with the peak counters reset per phase, to see where the peak is.
        phases: dict[str, Any] = {}

        def phase(name: str, phases: dict[str, Any] = phases, step: int = step) -> None:
            if cuda:
                torch.cuda.synchronize()
                phases[name] = dict(
                    allocated=torch.cuda.memory_allocated(),
                    reserved=torch.cuda.memory_reserved(),
                    peak_allocated=torch.cuda.max_memory_allocated(),
                )
                if step == 3:
                    torch.cuda.reset_peak_memory_stats()

        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if step in (1, 2):
            mark(f"step{step}")
        phase("start")
        loss = model(**batch).loss
        phase("forward")
        loss.backward()
        phase("backward")
        opt.step()
        phase("optimizer")
        opt.zero_grad(set_to_none=True)
        rec[f"loss{step}"] = float(loss.detach())
        del loss
        phase("end")
        if step == 2 and tracing:
            mark("step2_end")
            rec["trace_file"] = write_trace(c, torch.cuda.memory._snapshot(), Path(c["trace"]))
            torch.cuda.memory._record_memory_history(enabled=None)
        if cuda:
            stats = torch.cuda.memory_stats()
            rec[f"step{step}"] = dict(
                phases=phases,
                peak_allocated=max(p["peak_allocated"] for p in phases.values()),
                peak_reserved=torch.cuda.max_memory_reserved(),
                alloc_retries=stats.get("num_alloc_retries", 0),
                ooms=stats.get("num_ooms", 0),
                allocator={
                    k: stats.get(k, 0)
                    for k in (
                        "reserved_bytes.large_pool.current",
                        "reserved_bytes.small_pool.current",
                        "inactive_split_bytes.all.peak",
                        "segment.all.current",
                        "allocation.all.peak",
                    )
                },
            )
    if cuda:
        rec["nvml_process_end"] = nvml_process_bytes(pid)
        rec["measured_total"] = rec["step2"]["peak_reserved"] + (rec["context_bytes"] or 0)
    return rec


def _frame_tag(frames: list[dict[str, Any]]) -> str:
    """The innermost two Python frames outside torch's own plumbing, as file:line:function."""
    keep = []
    for f in frames:
        name = f.get("filename", "")
        if "torch/cuda/memory" in name or "torch/utils/_" in name or "<" in name:
            continue
        keep.append(f"{Path(name).name}:{f.get('line')}:{f.get('name')}")
        if len(keep) == 2:
            break
    return " < ".join(keep)


def write_trace(c: dict[str, Any], snapshot: dict[str, Any], root: Path) -> str:
    """The allocator events of the device as compact JSON (gzip): one [action, address, size,
    tag] per event, tags interned; plus the segments at the end."""
    import gzip

    actions = {"alloc": 0, "free_requested": 1, "free_completed": 2, "segment_alloc": 3}
    actions.update(segment_free=4, segment_map=5, segment_unmap=6, oom=7, snapshot=8)
    tags: dict[str, int] = {}
    events = []
    for e in snapshot["device_traces"][0]:
        tag = _frame_tag(e.get("frames") or [])
        events.append(
            [actions.get(e["action"], 9), e["addr"], e["size"], tags.setdefault(tag, len(tags))]
        )
    segments = [[s["address"], s["total_size"], s["allocated_size"]] for s in snapshot["segments"]]
    name = "{arch}-L{layers}-b{batch}-s{seq}-gc{gc:d}.json.gz".format(**c)
    root.mkdir(parents=True, exist_ok=True)
    doc = dict(
        config={k: v for k, v in c.items() if k != "trace"},
        actions=list(actions),
        marks=[MARK, *MARK_POINTS],
        tags=list(tags),
        events=events,
        segments=segments,
    )
    with gzip.open(root / name, "wt") as f:
        json.dump(doc, f, separators=(",", ":"))
    return name


SDPA_NAMES = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def context_probe(result_path: str) -> None:
    """CUDA context alone: NVML per process and device-level delta, nothing else running."""
    import torch

    used0 = nvml_device_used()
    torch.cuda.init()
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    rec = dict(
        probe="context",
        context_bytes=nvml_process_bytes(os.getpid()),
        device_used_delta=None if used0 is None else (nvml_device_used() or 0) - used0,
        device_name=torch.cuda.get_device_name(0),
        device_total=torch.cuda.get_device_properties(0).total_memory,
    )
    with open(result_path, "a") as f:
        f.write(json.dumps(rec) + "\n")


# --- the scheduler -----------------------------------------------------------------------


def _needs_rerun(result_path: Path, c: dict[str, Any]) -> bool:
    """An OOM or allocator retry while sharing the GPU: measure it again, alone."""
    if not result_path.exists():
        return False
    keys = ("arch", "layers", "batch", "seq", "gc", "r", "dropout", "optim")
    for line in reversed(result_path.read_text().splitlines()):
        rec = json.loads(line)
        if all(rec.get(k) == c.get(k) for k in keys):
            retries = rec.get("step2", {}).get("alloc_retries", 0)
            return bool("OutOfMemory" in rec.get("error", "") or retries)
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/memory/results")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting runs after this")
    ap.add_argument("--gpu-budget-gib", type=float, default=72.0)
    ap.add_argument("--max-parallel", type=int, default=4)
    ap.add_argument("--ckpt-root", default=None)
    ap.add_argument("--only", default=None, help="comma-separated architectures")
    ap.add_argument("--smoke", action="store_true", help="two tiny configs on the CPU")
    ap.add_argument(
        "--holdout", action="store_true", help="measure HOLDOUT_CONFIGS into OUT/holdout.jsonl"
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="record the allocator events of TRACE_CONFIGS into OUT/traces.tar instead",
    )
    args = ap.parse_args()

    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result_path = out / ("holdout.jsonl" if args.holdout else "measured.jsonl")
    device = "cpu" if args.smoke else "cuda"

    configs = config_matrix()
    if args.smoke:
        configs = [c for c in configs if c["arch"] == "tiny"]
    if args.holdout:
        configs = list(HOLDOUT_CONFIGS)
    if args.trace:
        configs = [dict(c, trace=str(out / "traces")) for c in TRACE_CONFIGS]
    if args.only:
        keep = set(args.only.split(","))
        configs = [c for c in configs if c["arch"] in keep]

    if args.ckpt_root:
        root = Path(args.ckpt_root)
    else:
        shm = Path("/dev/shm")
        free = shutil.disk_usage(shm).free if shm.exists() else 0
        root = shm / "nybble-ckpt" if free > 32 * 2**30 else Path("/tmp/nybble-ckpt")
    root.mkdir(parents=True, exist_ok=True)

    from importlib.metadata import version

    # The parent imports no torch/transformers/peft: on the GPU machine one of those imports
    # initialises CUDA, after which forking is unsafe. Each child imports them itself.
    env: dict[str, Any] = dict(
        python=sys.version.split()[0], ckpt_root=str(root), n_configs=len(configs)
    )
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "accelerate"):
        try:
            env[pkg] = version(pkg)
        except Exception as e:
            env[pkg] = f"not found: {e}"
    if not args.smoke:
        import subprocess

        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    (out / "environment.json").write_text(json.dumps(env, indent=2))
    print(json.dumps(env), flush=True)

    ctx = mp.get_context("fork")
    names = {checkpoint_name(c["arch"], c["layers"]) for c in configs}
    order = [(a, n) for a, n in CHECKPOINTS if f"{a}-L{n}" in names]
    if not args.smoke:
        probe = ctx.Process(target=context_probe, args=(str(out / "context.jsonl"),))
        probe.start()
        probe.join()
    ck = ctx.Process(target=checkpoint_worker, args=(order, str(root)))
    ck.start()

    pending = list(configs)
    running: list[tuple[Any, dict[str, Any], float]] = []
    budget = args.gpu_budget_gib * 2**30
    while pending or running:
        now = time.time() - t_start
        for item in list(running):
            proc, c, _ = item
            if not proc.is_alive():
                proc.join()
                running.remove(item)
                print(f"[{now:6.1f}s] done {c} rc={proc.exitcode}", flush=True)
                if not c.get("exclusive") and _needs_rerun(result_path, c):
                    pending.insert(0, dict(c, exclusive=True))
        if now > args.budget_s:
            if pending:
                print(
                    f"[{now:6.1f}s] budget reached; {len(pending)} configs not started", flush=True
                )
                (out / "not_run.json").write_text(json.dumps(pending))
            pending = []
        in_use = sum(r for _, _, r in running)
        started = False
        for c in list(pending):
            if len(running) >= args.max_parallel:
                break
            if not (root / checkpoint_name(c["arch"], c["layers"]) / "done").exists():
                continue
            need = rough_peak_bytes(c)
            if running and (in_use + need > budget or c.get("exclusive")):
                continue
            if any(r[1].get("exclusive") for r in running):
                break
            proc = ctx.Process(target=run_config, args=(c, str(root), device, str(result_path)))
            proc.start()
            running.append((proc, c, need))
            pending.remove(c)
            in_use += need
            started = True
            print(f"[{now:6.1f}s] start {c} (rough {need / 2**30:.1f} GiB)", flush=True)
        if not started:
            time.sleep(0.2)
        if time.time() - t_start > args.budget_s + 90:
            for proc, c, _ in running:
                print(f"killing {c}", flush=True)
                proc.kill()
            break
    if ck.is_alive():
        ck.kill()
    print(f"finished in {time.time() - t_start:.1f}s", flush=True)
    if args.trace and (out / "traces").is_dir():
        import tarfile

        with tarfile.open(out / "traces.tar", "w") as tar:
            tar.add(out / "traces", arcname="traces")
        shutil.rmtree(out / "traces")
    print_summary(result_path)
    return 0


def print_summary(result_path: Path) -> None:
    if not result_path.exists():
        return
    gib = 2**30
    for line in result_path.read_text().splitlines():
        r = json.loads(line)
        head = f"{r['arch']:>13} L{r['layers']:<2} b{r['batch']} s{r['seq']:<5} gc={int(r['gc'])}"
        head += "".join(f" {k}={r[k]}" for k in ("r", "dropout", "optim") if k in r)
        if "error" in r or "step2" not in r:
            print(head, "ERROR", r.get("error", "no step2"))
            continue
        s2, s3 = r["step2"], r["step3"]
        ph = {k: round(v["peak_allocated"] / gib, 3) for k, v in s3["phases"].items()}
        print(
            head,
            f"total {r['measured_total'] / gib:.3f}",
            f"res {s2['peak_reserved'] / gib:.3f}",
            f"alloc {s2['peak_allocated'] / gib:.3f}",
            f"ctx {(r.get('context_bytes') or 0) / 2**20:.0f}M",
            f"s3res {s3['peak_reserved'] / gib:.3f}",
            f"retry {s2['alloc_retries']}",
            f"sdpa {r.get('sdpa_choice_float32')}",
            f"ph {ph}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
