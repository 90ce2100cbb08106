"""`nybble train`: fine-tune a small decoder-only LM on the built-in corpus with LoRA, QLoRA or
fully (nybble.train; docs/training.md), with a progress bar, a loss curve and the adapter as
PEFT files. A checkpoint written every few steps lets `--resume` continue a killed run to the
same final loss as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from .. import LoraConfig
from .._files import atomic_write, remove_stale_temporaries
from ..train import Trainer, TransformerConfig, corpus_batch
from ..train.data import CORPUS_BYTES
from ._common import CliError, print_json

CHECKPOINT = "checkpoint.safetensors"
CONFIG = "config.json"
LOSSES = "losses.json"
PLOT = "loss.png"
#: The corpus and the way batches are drawn from it; a resumed run must use the same.
DATA_FORMAT = f"generated-v1-{CORPUS_BYTES}"

_DESCRIPTION = """\
Fine-tune a decoder-only LM (HF Llama's layout; random weights from --seed) on nybble's
built-in corpus, byte by byte: LoRA on the projections --targets names (QLoRA with --quant
nf4), or every weight with --full. Writes into --out: the adapter as PEFT files (adapter/),
the loss curve (loss.png, needs the plot extra), the losses (losses.json), the model's
config.json, and checkpoint.safetensors, from which --resume continues a stopped run exactly.
"""

_EPILOG = """\
examples:
  nybble train --steps 300 --out run1
  nybble train --quant nf4 --lora-r 16 --targets all-linear --out run2
  nybble train --device cuda --steps 1000 --out run3          (needs CuPy and a GPU)
  nybble train --out run1 --resume --steps 600                 (continue run1 to 600 steps)

exit codes: 0 done, 1 bad input (one line on stderr), 2 usage.
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        help="fine-tune a small LM on the built-in corpus (LoRA, QLoRA or full)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    p.add_argument(
        "--config", default="tiny", help="'tiny', or an HF config.json (or its folder) to train"
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to reach")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 x r)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout")
    p.add_argument(
        "--targets",
        default="all-linear",
        help="projections to adapt: all-linear, or names (q_proj,v_proj,...)",
    )
    p.add_argument("--full", action="store_true", help="train every weight, no LoRA")
    p.add_argument("--quant", default="none", choices=["none", "nf4"], help="base weights")
    p.add_argument("--double-quant", action="store_true", help="quantize the NF4 scales too")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="activations (default: float32 on the CPU, bfloat16 on the GPU)",
    )
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip (0: off)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="weights, LoRA init and batches")
    p.add_argument("--out", default="nybble-train", help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument(
        "--log-every",
        type=int,
        default=0,
        help="without a terminal, a progress line every N steps (0: a tenth of the run)",
    )
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip loss.png")
    p.add_argument("--save-base", action="store_true", help="also write the base model (base/)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def _model_config(spec: str) -> TransformerConfig:
    if spec == "tiny":
        return TransformerConfig.tiny()
    return TransformerConfig.from_hf(spec)


def _lora(args: argparse.Namespace) -> LoraConfig | None:
    if args.full:
        return None
    targets: str | tuple[str, ...] = args.targets
    if args.targets != "all-linear":
        targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
        if not targets:
            raise CliError("--targets: name at least one projection, or all-linear")
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_r
    return LoraConfig(
        r=args.lora_r,
        alpha=alpha,
        dropout=args.lora_dropout,
        target_modules=targets,
        seed=args.seed,
    )


def _check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "batch_size", "seq_len", "accumulation", "save_every"):
        if getattr(args, name) < 1:
            raise CliError(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    if args.log_every < 0:
        raise CliError(f"--log-every must be >= 0, got {args.log_every}")
    if not math.isfinite(args.max_grad_norm) or args.max_grad_norm < 0:
        raise CliError(f"--max-grad-norm must be >= 0, got {args.max_grad_norm}")


def _plot_module() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError(
            "the loss curve needs matplotlib: pip install 'nybble[plot]' (or pass --no-plot)"
        ) from None
    return plt


class Progress:
    """A one-line progress bar on a terminal (redrawn at most 10 times a second), otherwise a
    plain line every `every` steps; both on stderr."""

    def __init__(self, total: int, every: int) -> None:
        self.total = total
        self.every = every
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.tty:
            now = time.monotonic()
            if now - self._last < 0.1 and step < self.total:
                return
            self._last = now
            width = 24
            filled = int(width * step / self.total)
            bar = "#" * filled + "." * (width - filled)
            sys.stderr.write(
                f"\r{step:>{len(str(self.total))}}/{self.total} [{bar}] loss {loss:.4f}  "
                f"{tokens_per_s:,.0f} tok/s "
            )
            if step >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif step % self.every == 0 or step == self.total:
            print(
                f"step {step}/{self.total} loss {loss:.4f} tokens/s {tokens_per_s:.0f}",
                file=sys.stderr,
                flush=True,
            )


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    plt = _plot_module() if args.plot else None
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a directory")
    checkpoint = out / CHECKPOINT
    if checkpoint.exists() and not args.resume:
        raise CliError(
            f"{checkpoint} exists: pass --resume to continue that run, or choose another --out"
        )
    trainer = Trainer(
        _model_config(args.config),
        _lora(args),
        lr=args.lr,
        accumulation_steps=args.accumulation,
        quant=None if args.quant == "none" else args.quant,
        device=args.device,
        seed=args.seed,
        max_grad_norm=args.max_grad_norm or None,
        compute_dtype=args.dtype,
        gradient_checkpointing=args.gradient_checkpointing,
        double_quant=args.double_quant,
    )
    for holdout in (False, True):  # the corpus has room for these windows (ValueError if not)
        corpus_batch(0, args.batch_size, args.seq_len, seed=args.seed, holdout=holdout)
    data = {"format": DATA_FORMAT, "batch_size": args.batch_size, "seq_len": args.seq_len}
    losses: list[float] = []
    if args.resume and checkpoint.exists():
        extra = trainer.load_checkpoint(checkpoint)
        if extra.get("data") != data:
            raise CliError(
                f"{checkpoint} was trained on batches {extra.get('data')}, not {data}: resume "
                "with the same --batch-size and --seq-len"
            )
        losses = [float(v) for v in extra.get("losses", [])]
    elif args.resume:
        print(f"nybble train: no checkpoint in {out}; starting a new run", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out, (CHECKPOINT, CONFIG, LOSSES, PLOT))

    micro_total = args.steps * args.accumulation
    tokens_per_batch = args.batch_size * args.seq_len
    progress = Progress(args.steps, args.log_every or max(1, args.steps // 10))
    started = time.perf_counter()
    done_here = 0
    while len(losses) < micro_total:
        index = len(losses)
        inputs, targets = corpus_batch(index, args.batch_size, args.seq_len, seed=args.seed)
        losses.append(trainer.train_batch(inputs, targets))
        done_here += 1
        if trainer.micro_steps:
            continue
        rate = done_here * tokens_per_batch / max(time.perf_counter() - started, 1e-9)
        progress.update(trainer.step, losses[-1], rate)
        if trainer.step % args.save_every == 0 or len(losses) == micro_total:
            trainer.save_checkpoint(checkpoint, {"data": data, "losses": losses})
    elapsed = time.perf_counter() - started

    held_out = corpus_batch(0, args.batch_size, args.seq_len, seed=args.seed, holdout=True)
    summary: dict[str, Any] = {
        "steps": trainer.step,
        "micro_batches": len(losses),
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "held_out_loss": trainer.loss(*held_out),
        "tokens_per_s": done_here * tokens_per_batch / elapsed if done_here else None,
        "device": args.device,
        "mode": "full" if args.full else ("qlora" if args.quant == "nf4" else "lora"),
        "out": str(out),
    }
    with atomic_write(out / LOSSES, "w") as f:
        json.dump({**summary, "losses": losses}, f, indent=1)
        f.write("\n")
    with atomic_write(out / CONFIG, "w") as f:
        json.dump(trainer.config.to_hf(), f, indent=2)
        f.write("\n")
    if trainer.is_lora:
        trainer.save_adapter(out / "adapter")
        summary["adapter"] = str(out / "adapter")
    else:
        trainer.save_model(out / "model")
        summary["model"] = str(out / "model")
    if args.save_base and trainer.is_lora:
        trainer.save_model(out / "base")
        summary["base"] = str(out / "base")
    if plt is not None:
        _plot(plt, losses, args, out / PLOT)
        summary["plot"] = str(out / PLOT)
    if args.json:
        print_json(summary)
    else:
        print(
            f"trained {summary['steps']} steps ({summary['mode']}, {args.device}): loss "
            f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, held-out "
            f"{summary['held_out_loss']:.4f}; wrote {out}"
        )
    return 0


def _plot(plt: Any, losses: list[float], args: argparse.Namespace, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [(i + 1) / args.accumulation for i in range(len(losses))]
    ax.plot(steps, losses, lw=1, label="training batch")
    window = max(1, len(losses) // 20)
    if window > 1:
        smooth = [
            sum(losses[max(0, i - window + 1) : i + 1])
            / len(losses[max(0, i - window + 1) : i + 1])
            for i in range(len(losses))
        ]
        ax.plot(steps, smooth, lw=2, label=f"mean of {window}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    mode = "full fine-tuning" if args.full else f"LoRA r={args.lora_r}"
    quant = ", NF4 base" if args.quant == "nf4" else ""
    ax.set_title(f"nybble train: {mode}{quant}, {args.device}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
