"""Measure the GPU memory of transformers + PEFT + bitsandbytes QLoRA training, as users run it.

The protocol of docs/estimator.md, in one command on the GPU machine:

    python3 benchmarks/memory/measure_peft_bnb.py --out $OUT

- Every configuration runs in a fresh process (forked from a parent that never imports torch),
  several at once (the per-process figures are independent; a run that had to retry a
  cudaMalloc because the others filled the GPU is measured again, alone).
- The recipe: `BitsAndBytesConfig(load_in_4bit, nf4, double quant, bf16 compute)`,
  `from_pretrained(..., quantization_config=..., device_map="cuda")`,
  `prepare_model_for_kbit_training`, `get_peft_model` (r=16, alpha 32, dropout 0,
  all-linear), `model.train()`, torch AdamW.
- The loop (`--loops`): "plain" is the standard one (docs/estimator.md): `use_cache=False`,
  no task_type, each step
  `ids = torch.randint(..., device="cuda")`, `model(input_ids=ids, labels=ids).loss.backward()`,
  `opt.step()`, `opt.zero_grad(set_to_none=True)`. "benchmark" is the loop the committed
  results were measured with (one batch made before training, with an all-ones attention
  mask and a copy of the ids as labels; task_type CAUSAL_LM; the config's use_cache).
- `--steps` steps (4 by default, at least 3), peak counters reset before each; after each,
  `max_memory_reserved()`, `max_memory_allocated()`, `memory_reserved()` and NVML's memory of
  the process. The memory outside the allocator is NVML minus `memory_reserved()` right after
  the step; the measured total of a step is its reserved peak plus that; the figure compared
  with `estimate_memory(...).total_bytes` is the largest over steps 2 on (the steady state).
- Models are built from config dicts with random weights (nothing is downloaded): a bf16
  safetensors checkpoint per architecture is written once (to /dev/shm when it has room) and
  loaded with `from_pretrained`, the path a user takes, quantized by bitsandbytes on the way.
  A configuration loads the first `layers` layers (`num_hidden_layers` override).

What it writes to OUT: `results.jsonl` (one record per run, appended as each ends, so a run
cut short keeps what it measured), `environment.json`, `context.jsonl` (the process's NVML
memory after CUDA initialisation, after the first tensor op, after a training step),
`not_run.json` (what the deadline left out), `traces/*.json.gz` (allocation traces of the
`diagnose` set). `benchmarks/memory/compare.py --measured OUT/results.jsonl` makes the table.

A run that fails (an exception, a crash, a hang past `--timeout-s`) is recorded with its
error and the others go on. `--dry-run` runs the whole scheduler on this machine without torch
or a GPU (each run's measurement replaced by a short stand-in), `--configs FILE` measures a
JSON list of configurations instead of the sets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
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
    # small mixtures of experts (transformers 5 fuses the experts: memory.arch)
    "mixtral-small": dict(
        model_type="mixtral",
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        sliding_window=None,
    ),
    "qwen3-moe-small": dict(
        model_type="qwen3_moe",
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=151936,
        num_experts=32,
        num_experts_per_tok=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
    "qwen2-moe-small": dict(
        model_type="qwen2_moe",
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=704,
        shared_expert_intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=151936,
        num_experts=16,
        num_experts_per_tok=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
    ),
}

#: Marker allocations in a trace (a size no tensor of the step has; small pool, so they do
#: not disturb the large blocks): MARK + i bytes at the i-th point of MARK_POINTS. The first
#: six are those of tests/fixtures/memory/traces (tests/memory/test_allocator_traces.py reads
#: "step2").
MARK = 777_001
MARK_POINTS = (
    "after_load", "after_prepare", "after_peft", "step1", "step2", "step2_end", "step3", "step4",
)  # fmt: skip


# --- configuration sets ------------------------------------------------------------------

#: What each set is for (`--sets`); together they are the validation of docs/estimator.md.
SETS = ("diagnose", "new", "committed", "holdout", "moe")
#: Sets measured only when named (`--sets moe-holdout,growth`): mixtures of experts measured
#: after the estimator's expert model was written from the `moe` set, and a traced plain-loop
#: run whose step 2 reserves one more logits block than its step 1.
FOLLOW_UP_SETS = ("moe-holdout", "growth")


def config_id(c: dict[str, Any]) -> str:
    extra = "".join(f"-{k}{c[k]}" for k in ("r", "dropout", "optim") if k in c)
    return f"{c['arch']}-L{c['layers']}-b{c['batch']}-s{c['seq']}-gc{int(c['gc'])}{extra}"


def committed_configs() -> list[dict[str, Any]]:
    """The configurations of tests/fixtures/memory/old-protocol/measured.jsonl (measured with the
    benchmark loop), most important first."""
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
    base = dict(arch="qwen3-4b", layers=4, batch=1, seq=2048, gc=True)
    out += [dict(base, dropout=0.05), dict(base, optim="adamw8bit"), dict(base, r=64)]
    return out


#: tests/fixtures/memory/old-protocol/holdout.jsonl's configurations (held out of the model's
#: construction).
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

#: Held out of everything so far (the estimator's plain loop was written before they were
#: measured): other depths, lengths that are no power of two, larger batches, rank 32.
NEW_CONFIGS = [
    dict(arch="qwen3-0.6b", layers=28, batch=2, seq=1024, gc=True),
    dict(arch="llama-3.2-1b", layers=16, batch=8, seq=1024, gc=True),
    dict(arch="qwen3-4b", layers=36, batch=2, seq=512, gc=False),
    dict(arch="qwen3-0.6b", layers=28, batch=4, seq=640, gc=True),
    dict(arch="llama-3.2-1b", layers=16, batch=3, seq=1280, gc=False),
    dict(arch="mistral-7b", layers=6, batch=2, seq=1536, gc=True),
    dict(arch="llama-3.1-8b", layers=6, batch=1, seq=2560, gc=False),
    dict(arch="qwen3-4b", layers=12, batch=3, seq=768, gc=True, r=32),
    dict(arch="llama-2-7b", layers=6, batch=4, seq=896, gc=True, dropout=0.1),
    dict(arch="qwen3-0.6b", layers=28, batch=2, seq=2048, gc=True, r=8, optim="adamw8bit"),
    dict(arch="tiny", layers=2, batch=4, seq=256, gc=False),
]

#: Small mixtures of experts: transformers 5 keeps their experts unquantized (memory.arch);
#: the timeline's expert ops are written from the code and checked here.
MOE_CONFIGS = [
    dict(arch="mixtral-small", layers=4, batch=1, seq=1024, gc=True),
    dict(arch="mixtral-small", layers=4, batch=1, seq=1024, gc=False),
    dict(arch="qwen3-moe-small", layers=4, batch=2, seq=512, gc=True),
    dict(arch="qwen2-moe-small", layers=4, batch=1, seq=1024, gc=False),
]

#: MoE configurations none of the measured ones repeats (other batch and length pairs, depth
#: 2, the adapted experts of Qwen3-MoE without checkpointing).
MOE_HOLDOUT_CONFIGS = [
    dict(arch="mixtral-small", layers=4, batch=2, seq=512, gc=True),
    dict(arch="mixtral-small", layers=2, batch=1, seq=2048, gc=False),
    dict(arch="qwen3-moe-small", layers=4, batch=1, seq=1024, gc=False),
    dict(arch="qwen3-moe-small", layers=4, batch=4, seq=256, gc=True),
    dict(arch="qwen2-moe-small", layers=4, batch=2, seq=512, gc=True),
    dict(arch="qwen2-moe-small", layers=2, batch=1, seq=2048, gc=False),
]

#: A plain-loop run whose step 2 reserves one more logits block than step 1 (2740 -> 2990
#: MiB in the validation run; the figures issue 18 reported), traced in both loops.
GROWTH_CONFIGS = [dict(arch="llama-2-7b", layers=4, batch=1, seq=2048, gc=True)]

#: The configuration issue 18 reported growing after step 1 (llama-3.2-1b b1 s512 with
#: checkpointing; it reserved 2740 MiB at every step in the validation run) and one more, in
#: both loops, with the plain loop's allocations traced.
DIAGNOSE_CONFIGS = [
    dict(arch="llama-3.2-1b", layers=16, batch=1, seq=512, gc=True),
    dict(arch="qwen3-0.6b", layers=28, batch=1, seq=512, gc=True),
]


def unique_run_ids(configs: list[dict[str, Any]]) -> None:
    """A configuration two sets measure (the diagnose pair is in the committed set too) gets
    its set's name in the run id of every copy: each run writes runs/<id>.json and its trace
    under its own name."""
    seen: dict[str, int] = {}
    for c in configs:
        seen[c["run"]] = seen.get(c["run"], 0) + 1
    for c in configs:
        if seen[c["run"]] > 1:
            c["run"] = f"{c['run']}-{c.get('set', 'custom')}"
    taken: set[str] = set()
    for n, c in enumerate(configs):
        if c["run"] in taken:  # the same configuration twice in one set
            c["run"] = f"{c['run']}-{n}"
        taken.add(c["run"])


def select(sets: list[str], loops: list[str]) -> list[dict[str, Any]]:
    """The runs of `sets`, most important first; `diagnose` and `growth` run in both loops,
    the plain one traced."""
    chosen: list[dict[str, Any]] = []
    table = {
        "new": NEW_CONFIGS,
        "committed": committed_configs(),
        "holdout": HOLDOUT_CONFIGS,
        "moe": MOE_CONFIGS,
        "moe-holdout": MOE_HOLDOUT_CONFIGS,
    }
    traced = {"diagnose": DIAGNOSE_CONFIGS, "growth": GROWTH_CONFIGS}
    for name in (*SETS, *FOLLOW_UP_SETS):
        if name not in sets:
            continue
        if name in traced:
            for c in traced[name]:
                chosen.append(dict(c, set=name, loop="plain", trace=True))
                chosen.append(dict(c, set=name, loop="benchmark"))
            continue
        for c in table[name]:
            for loop in loops:
                chosen.append(dict(c, set=name, loop=loop))
    return chosen


# --- a rough, generous peak used only to admit concurrent runs ---------------------------


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
    experts = a.get("num_local_experts") or a.get("num_experts") or 0
    if experts:  # fused experts: bf16 loaded, float32 kept (and the bf16 hole)
        ie = a.get("moe_intermediate_size") or inter
        static += layers * experts * 3 * h * ie * 6
        inter = max(inter, ie * a["num_experts_per_tok"])
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


def checkpoint_depths(configs: list[dict[str, Any]]) -> dict[str, int]:
    """One checkpoint per architecture, as deep as its deepest configuration; a shallower one
    loads its first layers (the rest of the file is not read)."""
    depths: dict[str, int] = {}
    for c in configs:
        depths[c["arch"]] = max(depths.get(c["arch"], 0), c["layers"])
    return depths


def checkpoint_dir(root: Path, arch: str, depths: dict[str, int]) -> Path:
    return root / f"{arch}-L{depths[arch]}"


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
        try:
            write_checkpoint(arch, layers, Path(root))
            print(f"[ckpt] {arch}-L{layers} written in {time.time() - t0:.1f}s", flush=True)
        except Exception as e:  # its configurations fail one by one, clearly
            print(f"[ckpt] {arch}-L{layers} FAILED: {type(e).__name__}: {e}", flush=True)
            failed = Path(root) / f"{arch}-L{layers}"
            failed.mkdir(parents=True, exist_ok=True)
            (failed / "failed").write_text(f"{type(e).__name__}: {e}")


# --- NVML --------------------------------------------------------------------------------


def nvml_process_bytes(pid: int) -> int | None:
    """GPU memory NVML accounts to process `pid` (None when it cannot tell)."""
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


# --- one run, in its own process ---------------------------------------------------------


def run_config(c: dict[str, Any], root: str, out: str, dry_run: bool) -> None:
    """Measure one configuration and write OUT/runs/<id>.json (atomically), whatever happens."""
    t0 = time.time()
    rec: dict[str, Any] = {k: v for k, v in c.items() if k != "trace"}
    rec["config"] = dict(ARCHS[c["arch"]], num_hidden_layers=c["layers"])
    try:
        if dry_run:
            rec.update(_measure_dry(c))
        else:
            rec.update(_measure(c, Path(root), Path(out)))
    except BaseException as e:  # recorded, never fatal for the run
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        rec["traceback"] = traceback.format_exc()[-3000:]
    rec["wall_s"] = round(time.time() - t0, 2)
    _write_json(Path(out) / "runs" / f"{c['run']}.json", rec)


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _measure_dry(c: dict[str, Any]) -> dict[str, Any]:
    """A stand-in for `_measure` without torch: the scheduler, the files and compare.py run as
    on the GPU machine. `dry_fail` makes a run fail as real ones can ("raise", "crash",
    "hang"). The figures are the generous admission guess, not a measurement."""
    fail = c.get("dry_fail")
    if fail == "raise":
        raise RuntimeError("dry run: a failure inside the measurement")
    if fail == "crash":
        os._exit(3)
    if fail == "hang":
        time.sleep(3600)
    time.sleep(float(c.get("dry_sleep", 0.05)))
    rough = int(rough_peak_bytes(c))
    steps = []
    for k in range(1, int(c.get("n_steps", 4)) + 1):
        steps.append(
            dict(
                step=k,
                peak_reserved=rough,
                peak_allocated=rough * 9 // 10,
                reserved_end=rough * 8 // 10,
                nvml_process=rough * 8 // 10 + (742 << 20),
                outside=742 << 20,
                alloc_retries=0,
                loss=math.log(ARCHS[c["arch"]]["vocab_size"]),
            )
        )
    return dict(steps=steps, **_totals(steps))


def _totals(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The steady state: the step from the second on with the largest reserved peak plus
    memory outside the allocator after it."""
    later = [s for s in steps if s["step"] >= 2 and s.get("outside") is not None]
    if not later:
        return dict(measured_total=None)
    best = max(later, key=lambda s: s["peak_reserved"] + s["outside"])
    return dict(
        measured_total=best["peak_reserved"] + best["outside"],
        measured_reserved=best["peak_reserved"],
        measured_allocated=max(s["peak_allocated"] for s in later),
        outside_bytes=best["outside"],
        steady_step=best["step"],
        protocol="nvml-steady",
    )


def _measure(c: dict[str, Any], root: Path, out: Path) -> dict[str, Any]:
    import torch

    rec: dict[str, Any] = {}
    pid = os.getpid()
    torch.cuda.init()
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    rec["nvml_after_init"] = nvml_process_bytes(pid)

    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    path = Path(c["checkpoint"])
    cfg = AutoConfig.from_pretrained(str(path))
    cfg.num_hidden_layers = c["layers"]
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[: c["layers"]]
    if c["loop"] == "plain":
        cfg.use_cache = False
    tracing = bool(c.get("trace"))

    def mark(tag: str) -> None:
        if tracing and tag in MARK_POINTS:
            torch.empty(MARK + MARK_POINTS.index(tag), dtype=torch.uint8, device="cuda")

    def mem(tag: str) -> None:
        torch.cuda.synchronize()
        rec[tag] = dict(
            allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved()
        )
        mark(tag)

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
    if c["loop"] == "plain":
        model = AutoModelForCausalLM.from_pretrained(
            str(path), config=cfg, quantization_config=bnb, device_map="cuda"
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(path),
            config=cfg,
            quantization_config=bnb,
            dtype=torch.bfloat16,
            device_map={"": 0},
        )
    mem("after_load")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=c["gc"])
    mem("after_prepare")
    r = c.get("r", 16)
    lora = dict(r=r, lora_alpha=2 * r, lora_dropout=c.get("dropout", 0.0))
    lora["target_modules"] = "all-linear"
    if c["loop"] == "benchmark":
        lora["task_type"] = "CAUSAL_LM"
    model = get_peft_model(model, LoraConfig(**lora))
    mem("after_peft")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    rec["trainable_params"] = sum(p.numel() for p in params)
    rec["attn_implementation"] = model.config._attn_implementation
    rec["gc_active"] = bool(getattr(model.get_base_model(), "is_gradient_checkpointing", False))
    if c.get("optim", "adamw") == "adamw8bit":
        import bitsandbytes

        opt: Any = bitsandbytes.optim.AdamW8bit(params, lr=1e-4)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4)

    vocab, shape = cfg.vocab_size, (c["batch"], c["seq"])
    if c["loop"] == "benchmark":  # one batch, made before training, kept
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, vocab, shape, generator=gen).to("cuda")
        batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())

    steps = []
    for step in range(1, int(c.get("n_steps", 4)) + 1):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        mark(f"step{step}")
        if c["loop"] == "plain":
            ids = torch.randint(0, vocab, shape, device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
            loss = None
        else:
            loss = model(**batch).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step == 3 and tracing:  # setup and three steps
            rec["trace_file"] = write_trace(c, torch.cuda.memory._snapshot(), out / "traces")
            torch.cuda.memory._record_memory_history(enabled=None)
        stats = torch.cuda.memory_stats()
        reserved_end = torch.cuda.memory_reserved()
        nvml = nvml_process_bytes(pid)
        steps.append(
            dict(
                step=step,
                peak_reserved=torch.cuda.max_memory_reserved(),
                peak_allocated=torch.cuda.max_memory_allocated(),
                reserved_end=reserved_end,
                allocated_end=torch.cuda.memory_allocated(),
                nvml_process=nvml,
                outside=None if nvml is None else nvml - reserved_end,
                alloc_retries=stats.get("num_alloc_retries", 0),
                ooms=stats.get("num_ooms", 0),
                segments=stats.get("segment.all.current", 0),
                loss=None if loss is None else float(loss.detach()),
            )
        )
        del loss
    rec["steps"] = steps
    rec.update(_totals(steps))
    return rec


# --- allocation traces -------------------------------------------------------------------


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
    name = f"{c['run']}.json.gz"
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


# --- the context probe -------------------------------------------------------------------


def context_probe(out: str) -> None:
    """What the process holds outside the allocator, alone on the GPU: after CUDA init, after
    the first tensor op (on the H100: 518 and 612 MiB)."""
    import torch

    pid = os.getpid()
    torch.cuda.init()
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    after_init = nvml_process_bytes(pid)
    x = torch.ones(1024, device="cuda") + 1
    torch.cuda.synchronize()
    rec = dict(
        probe="context",
        after_init=after_init,
        after_first_op=nvml_process_bytes(pid),
        reserved_after_first_op=torch.cuda.memory_reserved(),
        device_name=torch.cuda.get_device_name(0),
        device_total=torch.cuda.get_device_properties(0).total_memory,
    )
    del x
    with open(Path(out) / "context.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


# --- the scheduler -----------------------------------------------------------------------


class Running:
    def __init__(self, proc: Any, c: dict[str, Any], need: float, started: float) -> None:
        self.proc, self.c, self.need, self.started = proc, c, need, started


def finish(run: Running, out: Path, results: Path, timed_out: bool) -> dict[str, Any]:
    """The run's record (its own file, or what is known of a run that left none), appended to
    results.jsonl by this process only, so lines never interleave."""
    path = out / "runs" / f"{run.c['run']}.json"
    rec: dict[str, Any]
    if path.exists():
        rec = json.loads(path.read_text())
    else:
        rec = {k: v for k, v in run.c.items() if k != "trace"}
        rec["config"] = dict(ARCHS[run.c["arch"]], num_hidden_layers=run.c["layers"])
        rec["wall_s"] = round(time.time() - run.started, 2)
        if timed_out:
            rec["error"] = f"timeout: killed after {rec['wall_s']} s"
        else:
            rec["error"] = f"the process died (exit code {run.proc.exitcode}) before writing"
    with open(results, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return rec


def needs_rerun(rec: dict[str, Any]) -> bool:
    """Shared-GPU trouble: an out-of-memory or a cudaMalloc retry distorts the allocator's
    figures; such a run is measured again alone."""
    retried = any(s.get("alloc_retries") for s in rec.get("steps", []))
    return bool(retried or "OutOfMemory" in rec.get("error", ""))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--out", required=True, help="directory for results.jsonl and the rest")
    ap.add_argument(
        "--sets",
        default=",".join(SETS),
        help=f"of {', '.join(SETS + FOLLOW_UP_SETS)} (default: {', '.join(SETS)})",
    )
    ap.add_argument("--loops", default="plain", help="plain and/or benchmark, for every set")
    ap.add_argument("--configs", default=None, help="a JSON list of configurations instead")
    ap.add_argument("--steps", type=int, default=4, help="training steps per run (>= 3)")
    ap.add_argument("--parallel", type=int, default=10, help="runs at once at most")
    ap.add_argument("--gpu-budget-gib", type=float, default=72.0, help="GPU memory to share")
    ap.add_argument("--timeout-s", type=float, default=150.0, help="per run; then it is killed")
    ap.add_argument("--deadline-s", type=float, default=380.0, help="no new run after this")
    ap.add_argument("--ckpt-root", default=None, help="where checkpoints go (/dev/shm)")
    ap.add_argument("--dry-run", action="store_true", help="no torch, no GPU: check the plumbing")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be at least 3")

    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    if args.configs:
        configs = [dict(c) for c in json.loads(Path(args.configs).read_text())]
        for c in configs:
            c.setdefault("set", "custom")
            c.setdefault("loop", "plain")
    else:
        loops = [x.strip() for x in args.loops.split(",") if x.strip()]
        sets = [x.strip() for x in args.sets.split(",") if x.strip()]
        for name in (*loops, *sets):
            if name not in (*SETS, *FOLLOW_UP_SETS, "plain", "benchmark"):
                ap.error(f"unknown set or loop {name!r}")
        configs = select(sets, loops)
    depths = checkpoint_depths(configs)
    if args.ckpt_root:
        root = Path(args.ckpt_root)
    else:
        shm = Path("/dev/shm")
        free = shutil.disk_usage(shm).free if shm.exists() else 0
        root = (
            shm / "nybble-ckpt"
            if free > 40 * 2**30
            else Path(tempfile.gettempdir()) / "nybble-ckpt"
        )
    root.mkdir(parents=True, exist_ok=True)
    for c in configs:
        c.setdefault("n_steps", args.steps)
        if args.dry_run:
            c["dry_run"] = True
        c["run"] = f"{config_id(c)}-{c['loop']}"
        c["checkpoint"] = str(checkpoint_dir(root, c["arch"], depths))
    unique_run_ids(configs)
    env = environment(args, root, len(configs))
    (out / "environment.json").write_text(json.dumps(env, indent=2))
    print(json.dumps(env), flush=True)

    ctx = mp.get_context("fork")  # the parent has not imported torch: forking is safe
    writers = []
    if args.dry_run:
        for arch, layers in depths.items():
            (root / f"{arch}-L{layers}").mkdir(parents=True, exist_ok=True)
            (root / f"{arch}-L{layers}" / "done").write_text("dry run")
    else:
        probe = ctx.Process(target=context_probe, args=(str(out),))
        probe.start()
        probe.join(timeout=120)
        # two writers, each taking every other architecture in order of first need
        order = list(dict.fromkeys(c["arch"] for c in configs))
        for part in (order[0::2], order[1::2]):
            wanted = [(a, depths[a]) for a in part]
            w = ctx.Process(target=checkpoint_worker, args=(wanted, str(root)))
            w.start()
            writers.append(w)

    running: list[Running] = []
    try:
        schedule(args, configs, running, out, results, root, ctx, t_start)
    finally:  # whatever happens here, no run is left behind
        for run in running:
            if run.proc.is_alive():
                run.proc.kill()
        for w in writers:
            if w.is_alive():
                w.kill()
    return 0


def schedule(
    args: argparse.Namespace,
    configs: list[dict[str, Any]],
    running: list[Running],
    out: Path,
    results: Path,
    root: Path,
    ctx: Any,
    t_start: float,
) -> None:
    """Start runs while the GPU budget and `--parallel` allow, collect them as they end."""
    pending = list(configs)
    rerun_done: set[str] = set()
    budget = args.gpu_budget_gib * 2**30
    counts = dict(done=0, failed=0)
    while pending or running:
        now = time.time()
        for run in list(running):
            timed_out = now - run.started > args.timeout_s
            if run.proc.is_alive() and not timed_out:
                continue
            if timed_out and run.proc.is_alive():
                run.proc.kill()
            run.proc.join()
            running.remove(run)
            rec = finish(run, out, results, timed_out)
            ok = "error" not in rec
            counts["done" if ok else "failed"] += 1
            total = rec.get("measured_total")
            print(
                f"[{now - t_start:6.1f}s] {'done' if ok else 'FAILED'} {run.c['run']} "
                + (f"total {total / 2**30:.3f} GiB" if total else rec.get("error", "")),
                flush=True,
            )
            if needs_rerun(rec) and run.c["run"] not in rerun_done:
                rerun_done.add(run.c["run"])
                pending.append(dict(run.c, exclusive=True))
        if now - t_start > args.deadline_s and pending:
            print(f"[{now - t_start:6.1f}s] deadline: {len(pending)} runs not started", flush=True)
            (out / "not_run.json").write_text(json.dumps(pending, indent=1))
            pending = []
        in_use = sum(r.need for r in running)
        started = False
        for c in list(pending):
            if len(running) >= args.parallel or any(r.c.get("exclusive") for r in running):
                break
            ckpt = Path(c["checkpoint"])
            if (ckpt / "failed").exists():
                pending.remove(c)
                rec = {k: v for k, v in c.items() if k != "trace"}
                rec["error"] = "checkpoint: " + (ckpt / "failed").read_text()
                with open(results, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                counts["failed"] += 1
                continue
            if not (ckpt / "done").exists():
                continue
            need = rough_peak_bytes(c)
            if running and (in_use + need > budget or c.get("exclusive")):
                continue
            with contextlib.suppress(FileNotFoundError):  # a stale one from an earlier run
                (out / "runs" / f"{c['run']}.json").unlink()
            proc = ctx.Process(target=run_config, args=(c, str(root), str(out), args.dry_run))
            proc.start()
            running.append(Running(proc, c, need, time.time()))
            pending.remove(c)
            in_use += need
            started = True
            print(f"[{time.time() - t_start:6.1f}s] start {c['run']} (~{need / 2**30:.1f} GiB)")
        if not started:
            time.sleep(0.1)
    print(
        f"finished in {time.time() - t_start:.1f}s: {counts['done']} measured, "
        f"{counts['failed']} failed; results in {results}",
        flush=True,
    )


def environment(args: argparse.Namespace, root: Path, n: int) -> dict[str, Any]:
    """Versions and the machine (the parent imports none of these packages)."""
    from importlib.metadata import version

    env: dict[str, Any] = dict(
        python=sys.version.split()[0], ckpt_root=str(root), runs=n, dry_run=args.dry_run
    )
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "nvidia-ml-py"):
        try:
            env[pkg] = version(pkg)
        except Exception as e:
            env[pkg] = f"not found: {type(e).__name__}"
    if not args.dry_run:
        import subprocess

        with contextlib.suppress(OSError):
            env["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,memory.total,driver_version",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
    return env


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
