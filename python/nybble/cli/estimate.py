"""`nybble estimate`: will a QLoRA fine-tune fit on my GPU? (docs/estimator.md)"""

from __future__ import annotations

import argparse
import re
from typing import Any

from ..memory import GPUS, LOOPS, MODEL_PRESETS, estimate_memory
from ..memory.estimate import MemoryEstimate, seq_len_step
from ..memory.frameworks import FRAMEWORKS
from ..memory.parts import BREAKDOWN_KEYS, DESCRIPTIONS, DISTRIBUTED_PARTS
from ..memory.presets import GiB
from ..memory.runtime import DEFAULT_OUTSIDE_ALLOCATOR, HIGHEST_OUTSIDE_ALLOCATOR
from ..memory.setup import STRATEGIES
from ._common import CliError, atomic_write, format_table, print_json

_DESCRIPTION = """\
Estimate the GPU memory of a (Q)LoRA fine-tune (transformers + PEFT + bitsandbytes): all the
memory the training process holds at the peak of a steady training step, as NVML reports it
for the process, and whether it fits on a GPU. The run's allocations are replayed through a
simulation of PyTorch's caching allocator, from the model load through the training steps.

Several GPUs (--gpus N): the peak of each GPU under FSDP (the default) or DDP, with the
same breakdown; modelled from the engines' code, checked against 1- and 2-GPU runs
(docs/estimator.md).

MODEL is a preset ({presets}),
a path to a Hugging Face config.json (or its folder), or a Hub id such as Qwen/Qwen3-4B whose
config.json is in the local Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub or
~/.cache/huggingface/hub; nothing is downloaded).
"""

_EPILOG = """\
sizes: binary units, as GPU makers label cards: 24GB = 24GiB = 24 x 2^30 bytes; also MB/MiB,
KB/KiB, TB/TiB. A bare number is GiB for --gpu (24 = 24GiB) and refused for --context.

the verdict (--gpu) counts, beyond the table's total, what the replay cannot rule out for a
training loop unlike the modelled one: one more block the size of the step's largest tensor
from step 2 on (docs/estimator.md), and the memory outside the allocator at the most measured.

GPUs (--gpu; case, spaces and dashes are ignored: H100-80GB, h100, "RTX 4090"):
{gpus}
  a100 and h100 mean their 80 GB versions.

examples:
  nybble estimate qwen3-4b --gpu rtx4090
  nybble estimate llama-3.1-8b -b 4 -s 1024 --gpu a100-40g --json
  nybble estimate ./my-model/config.json --no-grad-checkpointing --gpu 24GB
  nybble estimate Qwen/Qwen3-4B --gpu l4 --plot qwen3-4b.png   (plot: pip install "nybble[plot]")
  nybble estimate llama-3.1-70b --gpus 4 --framework nybble-torch --gpu h100
  nybble estimate llama-3.1-70b --gpus 2 --offload --framework nybble-torch --gpu 24GB

exit codes: 0 done, 1 bad input (one line on stderr), 2 usage.
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after an option's help where they say something: not for on/off flags, for
    options without one (None), or where the help states it already; description and epilog
    kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or isinstance(default, bool) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


#: A size without a unit.
_BARE_NUMBER = re.compile(r"\s*([0-9]+(\.[0-9]*)?|\.[0-9]+)\s*")


def _gpu_table() -> str:
    rows = [
        f"{name} ({spec.label}, {spec.total_bytes / GiB:.2f} GiB)" for name, spec in GPUS.items()
    ]
    lines, line = [], " "
    for row in rows:
        if len(line) + len(row) + 2 > 96:
            lines.append(line.rstrip(","))
            line = " "
        line += f" {row},"
    lines.append(line.rstrip(","))
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "estimate",
        help="estimate the GPU memory of a (Q)LoRA fine-tune; will it fit?",
        description=_DESCRIPTION.format(presets=", ".join(MODEL_PRESETS)),
        epilog=_EPILOG.format(gpus=_gpu_table()),
        formatter_class=_Formatter,
    )
    p.add_argument("model", metavar="MODEL", help="preset, config.json path or cached Hub id")
    p.add_argument(
        "--gpu",
        default=None,
        help="GPU to answer for: a name (see below) or its memory in GiB (24, 24GB or 24GiB: "
        "GPU labels' GB are GiB); adds the verdict, the largest batch and sequence that fit, "
        "and what to change when it does not fit",
    )
    p.add_argument(
        "--quant",
        default="nf4",
        help="format of the base weights: nf4, fp4, int8 (4 or 8 bits a weight), or "
        "bf16/f16/f32 (plain LoRA, 16 or 32 bits)",
    )
    p.add_argument(
        "--blocksize",
        type=int,
        default=64,
        help="weights per quantization scale (a power of two, 32 to 4096)",
    )
    p.add_argument(
        "--no-double-quant",
        dest="double_quant",
        action="store_false",
        help="keep the quantization scales in float32 (bnb_4bit_use_double_quant=False); "
        "by default they are quantized to 8 bits too",
    )
    p.add_argument(
        "--lora-r", "-r", type=int, default=16, help="LoRA rank (rows of A, columns of B)"
    )
    p.add_argument(
        "--targets",
        default="all-linear",
        help="LoRA target modules: all-linear, attention, mlp, or names (q_proj,v_proj,...)",
    )
    p.add_argument(
        "--lora-dtype",
        default="float32",
        help="dtype of the LoRA weights: float32 (4 bytes a value), bfloat16 or float16 (2)",
    )
    p.add_argument(
        "--lora-dropout",
        type=float,
        default=0.0,
        help="LoRA dropout: a probability from 0 (none) to below 1",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        help="adamw (torch: two float32 states a weight), adamw8bit (bitsandbytes: two 8-bit "
        "states), sgd (none)",
    )
    p.add_argument(
        "--batch", "-b", type=int, default=1, help="sequences per training step (micro-batch)"
    )
    p.add_argument("--seq-len", "-s", type=int, default=2048, help="tokens per sequence")
    p.add_argument(
        "--no-grad-checkpointing",
        dest="grad_checkpointing",
        action="store_false",
        help="turn gradient checkpointing off (it is on by default)",
    )
    p.add_argument(
        "--compute-dtype",
        default="bfloat16",
        help="dtype of the 4-bit layers' products (bnb_4bit_compute_dtype): bfloat16, "
        "float16 or float32",
    )
    p.add_argument(
        "--framework", default="peft-bnb", help=f"runtime modelled: {', '.join(FRAMEWORKS)}"
    )
    p.add_argument(
        "--gpus",
        default="1",
        metavar="N",
        help="GPUs the run is spread over: the estimate is then each GPU's (default strategy "
        "fsdp); frameworks peft-bnb and nybble-torch",
    )
    p.add_argument(
        "--strategy",
        default=None,
        help=f"how the GPUs share the run: {' or '.join(STRATEGIES)} (FSDP: shards, the "
        "default for several GPUs; DDP: a whole replica on each); given with one GPU, that "
        "runtime on one GPU",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="FSDP's CPU offload: shards, gradients and optimizer states in host memory "
        "(reported apart)",
    )
    p.add_argument(
        "--embedding-units",
        action="store_true",
        help="FSDP2 with the embeddings and the head as units of their own "
        "(shard_model(..., embedding_units=True); framework nybble-torch)",
    )
    p.add_argument(
        "--loop",
        default="plain",
        choices=LOOPS,
        help="training loop: plain (new batch each step, no attention mask; docs/estimator.md) or "
        "benchmark (benchmarks/memory/measure_peft_bnb.py's fixed batch)",
    )
    p.add_argument(
        "--context",
        default=None,
        metavar="SIZE",
        help="process memory outside torch's allocator (CUDA context and kernels) if you "
        "measured it (NVML process memory minus memory_reserved() after a step), with its "
        f"unit (751MiB, 0.75GiB); default: {DEFAULT_OUTSIDE_ALLOCATOR >> 20}MiB, measured on "
        f"an H100 with CUDA 13, torch 2.11 (the verdict counts {HIGHEST_OUTSIDE_ALLOCATOR >> 20}"
        "MiB, the most measured)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        default=None,
        help="write a PNG of memory (GiB) against sequence length (tokens); needs the plot extra",
    )
    p.set_defaults(func=run)


def _gpu(text: str | None) -> str | None:
    """--gpu: a bare number is GiB, as on a card's label (24 = 24GiB)."""
    if text is not None and _BARE_NUMBER.fullmatch(text):
        return text.strip() + "GiB"
    return text


def _context(text: str | None) -> str | None:
    """--context: a size with its unit; a bare number (bytes? MiB?) is refused."""
    if text is not None and _BARE_NUMBER.fullmatch(text):
        raise CliError(
            f"--context {text.strip()}: give the unit, as in {text.strip()}MiB or "
            f"{text.strip()}GiB (binary units)"
        )
    return text


def _gpus(text: str) -> int | str:
    """--gpus: a whole number; anything else goes on as given, for the estimate to name."""
    stripped = text.strip()
    return int(stripped) if stripped.isdecimal() and len(stripped) <= 9 else text


def run(args: argparse.Namespace) -> int:
    est = estimate_memory(
        args.model,
        quant=args.quant,
        blocksize=args.blocksize,
        double_quant=args.double_quant,
        lora_r=args.lora_r,
        targets=args.targets,
        lora_dtype=args.lora_dtype,
        lora_dropout=args.lora_dropout,
        optimizer=args.optimizer,
        batch=args.batch,
        seq_len=args.seq_len,
        grad_checkpointing=args.grad_checkpointing,
        compute_dtype=args.compute_dtype,
        framework=args.framework,
        loop=args.loop,
        context=_context(args.context),
        gpu=_gpu(args.gpu),
        gpus=_gpus(args.gpus),  # type: ignore[arg-type]  # a bad one is named by the estimate
        strategy=args.strategy,
        offload=args.offload,
        embedding_units=args.embedding_units,
    )
    report: dict[str, Any] = est.to_dict()
    if est.gpu is not None:
        gpu = report["gpu"]
        gpu["max_batch"] = est.max_batch()
        gpu["max_seq_len"] = est.max_seq_len(multiple_of=seq_len_step(est.setup.seq_len))
        gpu["suggestions"] = [
            dict(
                setting=x.setting,
                value=x.value,
                total_bytes=x.total_bytes,
                required_bytes=x.required_bytes,
                change=x.description,
            )
            for x in est.suggestions()
        ]
        report["notes"] = list(est.notes)  # the searches may add one
    if args.plot:
        try:
            from ..memory.plot import plot_seq_len

            with atomic_write(args.plot) as f:
                plot_seq_len(est, f)
        except ImportError as e:
            raise CliError(str(e)) from None
        report["plot"] = args.plot
    if args.json:
        print_json(report)
        return 0
    print(render(est, report))
    return 0


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _count(n: int) -> str:
    """1.24B, 11.3M, 34.6K, 120: a count in a unit that shows it."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def render(est: MemoryEstimate, report: dict[str, Any]) -> str:
    s = est.setup
    a = s.arch
    moe = f", {a.num_experts} experts ({a.experts_per_token} per token)" if a.is_moe else ""
    head = (
        f"{a.name}: {_count(a.num_parameters)} parameters, {a.num_layers} layers{moe}, "
        f"LoRA r={s.lora_r} on {len(s.targets)} kinds of linear layer"
        f"{' and the fused experts' if s.expert_targets else ''} "
        f"({_count(report['lora_parameters'])} trainable)\n"
        f"{s.quant}{' +double quant' if s.double_quant else ''}, {s.optimizer}, batch {s.batch} "
        f"x {s.seq_len} tokens, gradient checkpointing "
        f"{'on' if s.grad_checkpointing else 'off'}, {s.loop} loop, framework {est.framework}"
    )
    if s.distributed:
        head += (
            f"\n{s.gpus} GPU{'s' if s.gpus > 1 else ''}, strategy {s.strategy}"
            f"{', CPU offload' if s.offload else ''}"
            f"{', embeddings as units' if s.embedding_units else ''}: every figure below is "
            "one GPU's"
        )
    rows: list[list[Any]] = []
    for key in BREAKDOWN_KEYS:
        n = est.breakdown[key]
        if key in DISTRIBUTED_PARTS and not s.distributed:
            continue
        rows.append(
            [key.replace("_", " "), _gib(n), f"{100 * n / est.total_bytes:.1f}%", DESCRIPTIONS[key]]
        )
    rows.append(["total", _gib(est.total_bytes), "100.0%", "what the process holds at the peak"])
    table = format_table(["part", "GiB", "share", "what"], rows)
    lines = [head, "", table, ""]
    if est.host_bytes:
        parts = ", ".join(
            f"{k.replace('_', ' ')} {_gib(v)}" for k, v in est.host_breakdown.items() if v
        )
        lines.append(
            f"host memory (offload): {_gib(est.host_bytes)} GiB a process ({parts}); "
            f"{_gib(s.gpus * est.host_bytes)} GiB for {s.gpus} on one host"
        )
    lines.append(
        f"peak in: {est.peak_phase}; allocated {_gib(est.allocated_peak_bytes)} GiB, reserved "
        f"{_gib(est.reserved_peak_bytes)} GiB, outside the allocator {_gib(est.context_bytes)} "
        f"GiB: {est.context_source}"
    )
    required = est.required_bytes
    lines.append(
        f"margin: {_gib(est.margin_bytes)} GiB covers the most a measured run held beyond its "
        f"estimate (1% of the reserved peak, at least 20 MiB): plan with {_gib(required)} GiB "
        f"(the total and what the replay cannot rule out: see the notes), "
        f"{_gib(required + est.margin_bytes)} GiB to be safe"
    )
    lines += [f"note: {n}" for n in report["notes"]]
    gpu = report.get("gpu")
    if gpu:
        if gpu["fits"]:
            verdict = "fits" if gpu["fits_with_margin"] else "fits, but not with the margin"
        else:
            verdict = "does NOT fit"
        name = gpu["name"]
        size = f"{_gib(gpu['bytes'])} GiB"
        card = f"{name} ({gpu['label']}, {size})" if name in GPUS else f"a GPU of {size}"
        lines.append(
            f"{card}: {verdict} ({_gib(required)} GiB "
            f"counted), headroom {_gib(gpu['headroom_bytes'])} GiB; largest batch at seq_len "
            f"{s.seq_len}: {gpu['max_batch']}; longest seq_len at batch {s.batch} (a multiple "
            f"of {seq_len_step(s.seq_len)}): {gpu['max_seq_len']}"
        )
        if not gpu["fits"] and est.total_bytes <= gpu["bytes"]:
            lines.append(
                f"  the table's total ({_gib(est.total_bytes)} GiB) alone would fit: only if "
                "your loop's allocator reserves no more block from step 2 on (see the notes)"
            )
        suggestions = gpu.get("suggestions") or []
        if suggestions:
            first, *others = suggestions
            lines.append(
                f"smallest change that fits: {first['change']} "
                f"({_gib(first['required_bytes'])} GiB)"
            )
            for other in others:
                lines.append(f"  or: {other['change']} ({_gib(other['required_bytes'])} GiB)")
        elif not gpu["fits"]:
            experts = est.details.get("unquantized_experts", 0)
            if experts > gpu["bytes"] // 2:
                lines.append(
                    "no change of batch, sequence length, checkpointing, rank or double "
                    f"quantization makes it fit: the unquantized fused experts alone take "
                    f"{_gib(experts)} GiB (see the note on them for what to change)"
                )
            else:
                lines.append(
                    "no change of batch, sequence length, checkpointing, rank or double "
                    "quantization makes it fit: the weights alone need more (see the table)"
                )
    if "plot" in report:
        lines.append(f"plot written to {report['plot']}")
    return "\n".join(lines)
