"""`nybble estimate`: will a QLoRA fine-tune fit on my GPU? (SPEC §5)"""

from __future__ import annotations

import argparse
from typing import Any

from ..memory import MODEL_PRESETS, estimate_memory, parse_size
from ..memory.estimate import MemoryEstimate
from ..memory.frameworks import BREAKDOWN_KEYS, FRAMEWORKS
from ..memory.presets import GiB
from ._common import atomic_write, format_table, print_json


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "estimate",
        help="estimate peak GPU memory of a (Q)LoRA fine-tune; will it fit?",
        description=(
            "Estimate the peak GPU memory of one (Q)LoRA training step. MODEL is a preset "
            f"({', '.join(sorted(MODEL_PRESETS))}), a path to a Hugging Face config.json, "
            "or its folder."
        ),
    )
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--gpu", help="GPU memory: a size (24GiB, 16GB) or a name (rtx4090, a100-40g)")
    p.add_argument("--quant", default="nf4", help="base weights: nf4, fp4, int8, bf16, f16, f32")
    p.add_argument("--blocksize", type=int, default=64)
    p.add_argument("--no-double-quant", dest="double_quant", action="store_false")
    p.add_argument("--lora-r", "-r", type=int, default=16)
    p.add_argument("--targets", default="all-linear", help="all-linear or q_proj,v_proj,...")
    p.add_argument("--lora-dtype", default="float32")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--optimizer", default="adamw", help="adamw, adamw8bit, sgd")
    p.add_argument("--batch", "-b", type=int, default=1)
    p.add_argument("--seq-len", "-s", type=int, default=2048)
    p.add_argument("--no-grad-checkpointing", dest="grad_checkpointing", action="store_false")
    p.add_argument("--compute-dtype", default="bfloat16")
    p.add_argument("--framework", default="peft-bnb", help=", ".join(sorted(FRAMEWORKS)))
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG of memory vs sequence length")
    p.set_defaults(func=run)


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
    )
    gpu = parse_size(args.gpu) if args.gpu else None
    report: dict[str, Any] = est.to_dict()
    if gpu is not None:
        report["gpu"] = dict(
            name=args.gpu,
            bytes=gpu,
            fits=est.fits(gpu),
            headroom_bytes=est.headroom(gpu),
            max_batch=est.max_batch(gpu),
            max_seq_len=est.max_seq_len(gpu),
        )
    if args.plot:
        from ..memory.plot import plot_seq_len

        with atomic_write(args.plot) as f:
            plot_seq_len(est, f, gpu, args.gpu)
        report["plot"] = args.plot
    if args.json:
        print_json(report)
        return 0
    print(render(est, report))
    return 0


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def render(est: MemoryEstimate, report: dict[str, Any]) -> str:
    s = est.setup
    a = s.arch
    head = (
        f"{a.name}: {a.num_parameters / 1e9:.2f}B parameters, {a.num_layers} layers, "
        f"LoRA r={s.lora_r} on {len(s.targets)} projections "
        f"({report['lora_parameters'] / 1e6:.1f}M trainable)\n"
        f"{s.quant}{' +double quant' if s.double_quant else ''}, {s.optimizer}, batch {s.batch} "
        f"x {s.seq_len} tokens, gradient checkpointing "
        f"{'on' if s.grad_checkpointing else 'off'}, framework {est.framework}"
    )
    rows: list[list[Any]] = []
    for key in BREAKDOWN_KEYS:
        n = est.breakdown[key]
        rows.append([key.replace("_", " "), _gib(n), f"{100 * n / est.total_bytes:.1f}%"])
    rows.append(["total", _gib(est.total_bytes), "100.0%"])
    table = format_table(["component", "GiB", "share"], rows)
    lines = [head, "", table, ""]
    lines.append(
        f"peak at: {est.peak_phase}; allocated peak {_gib(est.allocated_peak_bytes)} GiB, "
        f"reserved peak {_gib(est.reserved_peak_bytes)} GiB, "
        f"CUDA context {_gib(est.context_bytes)} GiB"
    )
    lines += [f"note: {n}" for n in est.notes]
    gpu = report.get("gpu")
    if gpu:
        verdict = "fits" if gpu["fits"] else "does NOT fit"
        lines.append(
            f"{gpu['name']} ({_gib(gpu['bytes'])} GiB): {verdict}, headroom "
            f"{_gib(gpu['headroom_bytes'])} GiB; largest batch at seq_len {s.seq_len}: "
            f"{gpu['max_batch']}; longest seq_len at batch {s.batch}: {gpu['max_seq_len']}"
        )
    if "plot" in report:
        lines.append(f"plot written to {report['plot']}")
    return "\n".join(lines)
