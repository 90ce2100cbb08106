"""`nybble train`: fine-tune a pretrained model on your own data (--model, --data), or a small
random model on the built-in corpus, with LoRA, QLoRA or fully (nybble.train;
docs/training.md): a progress bar, eval loss and perplexity, a loss curve, the adapter as PEFT
files, optionally the merged model. A checkpoint written every few steps lets `--resume`
continue a killed run to the same final loss as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import LoraConfig
from .._files import atomic_write, remove_stale_temporaries
from ..errors import FormatError
from ..models import open_model
from ..train import Trainer, TransformerConfig, corpus_batch
from ..train.data import CORPUS_BYTES
from ..train.dataset import PackedBatches, file_digest, pieces, read_samples, split_eval
from ..train.schedule import KINDS, LRSchedule
from ._common import CliError, print_json

CHECKPOINT = "checkpoint.safetensors"
CONFIG = "config.json"
LOSSES = "losses.json"
PLOT = "loss.png"
#: The corpus and the way batches are drawn from it; a resumed run must use the same.
DATA_FORMAT = f"generated-v1-{CORPUS_BYTES}"
PACKED_FORMAT = "packed-v1"
#: Tokens of one micro-batch beyond which a run is refused before anything is allocated.
MAX_BATCH_TOKENS = 1 << 22
#: The largest learning rate taken (larger ones diverge to inf at once).
MAX_LR = 1.0

_DESCRIPTION = """\
Fine-tune a decoder-only LM with LoRA on the projections --targets names (QLoRA with --quant
nf4), or every weight with --full.

With --model (an HF checkpoint folder, a bitsandbytes 4-bit folder, a Hub id in the local HF
cache, or a .gguf file) and --data (.txt, .jsonl with text / prompt+completion / messages,
.parquet), trains the pretrained model on your data: samples packed into rows of --seq-len
tokens with attention kept inside each sample, the loss on completions and assistant turns
only, eval loss and perplexity on --eval-data or an --eval-fraction of the data.
Without --model, a small random model (--config) on nybble's built-in corpus, byte by byte.

Writes into --out: the adapter as PEFT files (adapter/), with --merge the merged model in
bf16 (merged/), the loss curve (loss.png, with matplotlib), the losses (losses.json), and
checkpoint.safetensors, from which --resume continues a stopped run exactly.
"""

_EPILOG = """\
examples:
  nybble train --model ./SmolLM2-135M-Instruct.Q4_1.gguf --data chats.jsonl --out run1
  nybble train --model meta-llama/Llama-3.1-8B --data train.jsonl --device cuda \\
      --seq-len 2048 --lora-r 16 --merge --out run2
  nybble train --steps 300 --out run3                           (the built-in tiny model)
  nybble train --out run1 --model ... --data ... --resume --steps 600   (continue run1)

exit codes: 0 done, 1 bad input (one line on stderr), 2 usage.
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown where there is one to show (not for flags, nor for a None that the
    help text explains)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action, argparse._StoreConstAction):
            return action.help
        return super()._get_help_string(action)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        help="fine-tune a pretrained model on your data, or a small LM on a built-in corpus",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    p.add_argument("--model", help="the pretrained model to fine-tune (folder, Hub id, .gguf)")
    p.add_argument("--data", help="training data (.txt, .jsonl, .parquet); needs --model")
    p.add_argument("--eval-data", help="held-out data for eval loss (default: --eval-fraction)")
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.05,
        help="share of --data held out for eval when there is no --eval-data",
    )
    p.add_argument("--eval-every", type=int, default=0, help="eval every N steps (0: 10 a run)")
    p.add_argument("--config", default="tiny", help="without --model: 'tiny', or an HF config.json")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps (default: --epochs of the data; 200 built-in)",
    )
    p.add_argument("--epochs", type=float, default=1.0, help="passes over --data (no --steps)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="rows per micro-batch (default: 4; 8 built-in)"
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="tokens per row (default: 1024; 64 built-in)"
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak AdamW learning rate (default: 2e-4; 3e-3 built-in)",
    )
    p.add_argument(
        "--schedule",
        choices=KINDS,
        default=None,
        help="lr schedule (default: cosine; constant built-in)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warmup steps (default: 3%% of the steps; 0 built-in)",
    )
    p.add_argument("--lora-r", type=int, default=None, help="LoRA rank (default: 16; 8 built-in)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 x r)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout")
    p.add_argument(
        "--targets",
        default="all-linear",
        help="projections to adapt: all-linear, or names (q_proj,v_proj,...)",
    )
    p.add_argument("--full", action="store_true", help="train every weight, no LoRA")
    p.add_argument(
        "--quant",
        default=None,
        choices=["none", "nf4"],
        help="base weights (default: nf4 with --model, none built-in)",
    )
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
    p.add_argument("--seed", type=int, default=0, help="data order, LoRA init (and random weights)")
    p.add_argument("--out", default="nybble-train", help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument(
        "--log-every",
        type=int,
        default=0,
        help="without a terminal, a progress line every N steps (0: a tenth of the run)",
    )
    p.add_argument(
        "--merge", action="store_true", help="also write the merged model (merged/, bf16)"
    )
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip loss.png")
    p.add_argument("--save-base", action="store_true", help="built-in: also write the base model")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


# --- arguments ------------------------------------------------------------------------------


def _pretrained(args: argparse.Namespace) -> bool:
    return args.model is not None


def _fill_defaults(args: argparse.Namespace) -> None:
    """Defaults that depend on the mode (a pretrained model or the built-in one)."""
    pre = _pretrained(args)
    for name, with_model, builtin in (
        ("batch_size", 4, 8),
        ("seq_len", 1024, 64),
        ("lr", 2e-4, 3e-3),
        ("schedule", "cosine", "constant"),
        ("lora_r", 16, 8),
        ("quant", "nf4", "none"),
    ):
        if getattr(args, name) is None:
            setattr(args, name, with_model if pre else builtin)
    if not pre and args.steps is None:
        args.steps = 200


def _check_args(args: argparse.Namespace) -> None:
    if args.data is not None and args.model is None:
        raise CliError("--data needs --model (the pretrained model to train on it)")
    if args.model is not None and args.data is None:
        raise CliError("--model needs --data (a .txt, .jsonl or .parquet file to train on)")
    if args.eval_data is not None and args.model is None:
        raise CliError("--eval-data needs --model and --data")
    for name in ("batch_size", "seq_len", "accumulation", "save_every", "lora_r"):
        if getattr(args, name) < 1:
            raise CliError(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    if args.steps is not None and args.steps < 1:
        raise CliError(f"--steps must be at least 1, got {args.steps}")
    tokens = args.batch_size * args.seq_len
    if tokens > MAX_BATCH_TOKENS:
        raise CliError(
            f"--batch-size x --seq-len is {tokens:,} tokens per micro-batch; at most "
            f"{MAX_BATCH_TOKENS:,} are taken (use --accumulation for larger batches)"
        )
    if args.log_every < 0 or args.eval_every < 0:
        raise CliError("--log-every and --eval-every must be >= 0")
    if not math.isfinite(args.max_grad_norm) or args.max_grad_norm < 0:
        raise CliError(f"--max-grad-norm must be >= 0, got {args.max_grad_norm}")
    if not (math.isfinite(args.lr) and 0 < args.lr <= MAX_LR):
        raise CliError(f"--lr must be in (0, {MAX_LR}], got {args.lr}")
    if not (math.isfinite(args.epochs) and 0 < args.epochs <= 1e6):
        raise CliError(f"--epochs must be > 0, got {args.epochs}")
    if not 0 <= args.eval_fraction < 1:
        raise CliError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if args.warmup is not None and args.warmup < 0:
        raise CliError(f"--warmup must be >= 0, got {args.warmup}")
    if args.merge and (args.full or args.model is None):
        raise CliError("--merge writes a LoRA run on --model merged into its base")


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


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _check_size(config: TransformerConfig, args: argparse.Namespace) -> None:
    """Refuses, before anything is allocated, a model whose weights alone exceed this
    machine's memory (on the CPU), and says what a large one will take."""
    params = config.num_parameters()
    per = 0.5625 if args.quant == "nf4" and not args.full else 4.0
    if args.full:
        per = 16.0  # weights, gradients and AdamW's two moments, float32
    need = params * per
    if args.device != "cpu":
        return
    memory = _physical_memory()
    gib = need / 2**30
    if memory is not None and need > memory:
        raise CliError(
            f"the model has {params / 1e9:.2f}B parameters: about {gib:.1f} GiB of weights "
            f"on the CPU, more than this machine's {memory / 2**30:.1f} GiB"
        )
    if params > 1e9:
        print(
            f"nybble train: note: {params / 1e9:.2f}B parameters on the CPU take about "
            f"{gib:.1f} GiB and train slowly; --device cuda is made for this size",
            file=sys.stderr,
        )


def _plot_module() -> Any:
    """matplotlib's pyplot, or None (the plot extra is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


# --- progress -------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on a terminal (redrawn at most 10 times a second), otherwise a
    plain line every `every` steps; both on stderr. Shows the loss, tokens/s, the time left
    and, on the GPU, the memory the run holds."""

    def __init__(self, total: int, every: int, memory: Callable[[], int | None]) -> None:
        self.total = total
        self.every = every
        self.memory = memory
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def update(self, step: int, loss: float, tokens_per_s: float, seconds_left: float) -> None:
        held = self.memory()
        extra = f"  {held / 2**30:.1f} GiB" if held is not None else ""
        eta = _duration(seconds_left)
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
                f"{tokens_per_s:,.0f} tok/s  ETA {eta}{extra} "
            )
            if step >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif step % self.every == 0 or step == self.total:
            print(
                f"step {step}/{self.total} loss {loss:.4f} tokens/s {tokens_per_s:.0f} "
                f"eta {eta}{extra}",
                file=sys.stderr,
                flush=True,
            )

    def note(self, text: str) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
        print(text, file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


# --- data -----------------------------------------------------------------------------------


@dataclass
class Data:
    """Where a run's batches come from: `batch(i)` -> (inputs, targets, starts or None),
    the eval batches, and a record a resumed run must match."""

    batch: Callable[[int], tuple[Any, Any, Any]]
    eval_batches: list[tuple[Any, Any, Any]]
    record: dict[str, Any]
    default_steps: int
    notes: list[str]


def _builtin_data(args: argparse.Namespace) -> Data:
    for holdout in (False, True):  # the corpus has room for these windows (ValueError if not)
        corpus_batch(0, args.batch_size, args.seq_len, seed=args.seed, holdout=holdout)

    def batch(i: int) -> tuple[Any, Any, Any]:
        inputs, targets = corpus_batch(i, args.batch_size, args.seq_len, seed=args.seed)
        return inputs, targets, None

    held = corpus_batch(0, args.batch_size, args.seq_len, seed=args.seed, holdout=True)
    record = {"format": DATA_FORMAT, "batch_size": args.batch_size, "seq_len": args.seq_len}
    return Data(batch, [(held[0], held[1], None)], record, 200, [])


def _dataset(args: argparse.Namespace, trainer: Trainer) -> Data:
    tok = trainer.tokenizer
    if tok is None:
        raise CliError(f"{args.model}: has no tokenizer (tokenizer.json) to read --data with")
    if tok.vocab_size > trainer.config.vocab_size:
        raise CliError(
            f"{args.model}: the tokenizer has {tok.vocab_size} tokens, the model's embedding "
            f"{trainer.config.vocab_size}"
        )
    samples = read_samples(args.data, tok)
    notes = []
    if args.eval_data is not None:
        train, held = samples, read_samples(args.eval_data, tok)
    else:
        train, held = split_eval(samples, args.eval_fraction, args.seed)
        if args.eval_fraction > 0 and not held:
            notes.append(
                f"no eval split: {len(samples)} samples are too few for --eval-fraction "
                f"{args.eval_fraction} (pass --eval-data)"
            )
    train_pieces, truncated = pieces(train, args.seq_len)
    if truncated:
        notes.append(f"{truncated} sample(s) longer than --seq-len {args.seq_len} truncated")
    if not train_pieces:
        raise CliError(f"{args.data}: no sample has a token to learn within --seq-len")
    pad = tok.pad_id
    batches = PackedBatches(train_pieces, args.seq_len, args.batch_size, args.seed, pad)
    eval_batches = []
    if held:
        held_pieces, _ = pieces(held, args.seq_len)
        if held_pieces:
            packed = PackedBatches(held_pieces, args.seq_len, args.batch_size, 0, pad, False)
            count = math.ceil(packed.rows_per_epoch / args.batch_size)
            eval_batches = [packed.batch(i) for i in range(count)]
    per_step = args.batch_size * args.accumulation
    steps = max(1, math.ceil(args.epochs * batches.rows_per_epoch / per_step))
    record = {
        "format": PACKED_FORMAT,
        "model": str(args.model),
        "data": file_digest(args.data),
        "eval": file_digest(args.eval_data) if args.eval_data else args.eval_fraction,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "seed": args.seed,
    }
    notes.insert(
        0,
        f"{len(train)} training samples ({len(train_pieces)} pieces, "
        f"{batches.rows_per_epoch} rows of {args.seq_len} tokens an epoch), "
        f"{len(held)} held out",
    )
    return Data(batches.batch, eval_batches, record, steps, notes)


def _eval_loss(trainer: Trainer, batches: list[tuple[Any, Any, Any]]) -> float | None:
    """The mean loss over every held-out target (each batch weighted by its targets)."""
    total, count = 0.0, 0
    for inputs, targets, starts in batches:
        n = int((np.asarray(targets) >= 0).sum())
        if n:
            total += trainer.loss(inputs, targets, starts) * n
            count += n
    return total / count if count else None


# --- the run --------------------------------------------------------------------------------


def _build(args: argparse.Namespace) -> Trainer:
    quant = None if args.quant == "none" else args.quant
    common: dict[str, Any] = dict(
        lr=args.lr,
        accumulation_steps=args.accumulation,
        max_grad_norm=args.max_grad_norm or None,
        compute_dtype=args.dtype,
        gradient_checkpointing=args.gradient_checkpointing,
        double_quant=args.double_quant,
        seed=args.seed,
    )
    if not _pretrained(args):
        config = (
            TransformerConfig.tiny()
            if args.config == "tiny"
            else TransformerConfig.from_hf(args.config)
        )
        _check_size(config, args)
        return Trainer(config, _lora(args), quant=quant, device=args.device, **common)
    with open_model(args.model) as files:  # its size, before a tensor is read
        _check_size(TransformerConfig.from_hf(files.config, where=str(files.path)), args)
    return Trainer.from_pretrained(
        args.model, _lora(args), quant=quant, device=args.device, **common
    )


def _schedule(args: argparse.Namespace, steps: int) -> LRSchedule:
    warmup = args.warmup
    if warmup is None:
        warmup = math.ceil(0.03 * steps) if _pretrained(args) else 0
    return LRSchedule(args.schedule, warmup, steps if args.schedule != "constant" else None)


def _read_losses(value: Any, checkpoint: Path) -> list[float]:
    if not isinstance(value, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value
    ):
        raise FormatError(checkpoint, "expected a list of finite numbers", "extra.losses")
    return [float(v) for v in value]


def run(args: argparse.Namespace) -> int:
    _fill_defaults(args)
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
    with_model = _pretrained(args)
    if with_model:
        trainer = _build(args)  # first: its tokenizer reads the data
        data = _dataset(args, trainer)
    else:
        data = _builtin_data(args)
        trainer = _build(args)
    steps = args.steps or data.default_steps
    trainer.schedule = _schedule(args, steps)

    losses: list[float] = []
    evals: list[dict[str, float]] = []
    if args.resume and checkpoint.exists():
        try:
            extra = trainer.load_checkpoint(checkpoint)
        except FormatError as e:
            if e.field != "schedule":
                raise
            raise CliError(
                f"{checkpoint}: the run was started with another learning-rate schedule "
                f"({e.problem}); resume with the same --steps, --schedule and --warmup"
            ) from None
        if extra.get("data") != data.record:
            raise CliError(
                f"{checkpoint} was trained on {extra.get('data')}, not {data.record}: resume "
                "with the same model, data, --batch-size, --seq-len and --seed"
            )
        losses = _read_losses(extra.get("losses", []), checkpoint)
        evals = [e for e in extra.get("evals", []) if isinstance(e, dict)]
        if trainer.step >= steps:
            print(
                f"nybble train: {checkpoint} is already at step {trainer.step} >= --steps "
                f"{steps}: nothing to train (pass a larger --steps to continue)",
                file=sys.stderr,
            )
    elif args.resume:
        print(f"nybble train: no checkpoint in {out}; starting a new run", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out, (CHECKPOINT, CONFIG, LOSSES, PLOT))

    progress = Progress(steps, args.log_every or max(1, steps // 10), trainer.backend.memory_in_use)
    for note in data.notes:
        progress.note(f"nybble train: {note}")
    eval_every = args.eval_every or max(1, steps // 10)
    micro_total = steps * args.accumulation
    started = time.perf_counter()
    tokens_here = 0
    micro_here = 0
    while len(losses) < micro_total:
        inputs, targets, starts = data.batch(len(losses))
        losses.append(trainer.train_batch(inputs, targets, starts))
        tokens_here += int(np.asarray(inputs).size)
        micro_here += 1
        if trainer.micro_steps:
            continue
        elapsed = max(time.perf_counter() - started, 1e-9)
        left = (micro_total - len(losses)) * elapsed / micro_here
        progress.update(trainer.step, losses[-1], tokens_here / elapsed, left)
        if data.eval_batches and (trainer.step % eval_every == 0 or len(losses) == micro_total):
            value = _eval_loss(trainer, data.eval_batches)
            if value is not None:
                evals.append({"step": trainer.step, "loss": value, "perplexity": _ppl(value)})
                progress.note(
                    f"step {trainer.step}: eval loss {value:.4f}, perplexity {_ppl(value):.2f}"
                )
        if trainer.step % args.save_every == 0 or len(losses) == micro_total:
            trainer.save_checkpoint(
                checkpoint, {"data": data.record, "losses": losses, "evals": evals}
            )
    elapsed = time.perf_counter() - started

    held_out = _eval_loss(trainer, data.eval_batches) if data.eval_batches else None
    summary: dict[str, Any] = {
        "steps": trainer.step,
        "micro_batches": len(losses),
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "held_out_loss": held_out,
        "held_out_perplexity": _ppl(held_out) if held_out is not None else None,
        "tokens_per_s": tokens_here / elapsed if micro_here else None,
        "device": args.device,
        "mode": "full" if args.full else ("qlora" if args.quant == "nf4" else "lora"),
        "model": args.model,
        "out": str(out),
    }
    with atomic_write(out / LOSSES, "w") as f:
        json.dump({**summary, "losses": losses, "evals": evals}, f, indent=1)
        f.write("\n")
    with atomic_write(out / CONFIG, "w") as f:
        json.dump(trainer.config.to_hf(), f, indent=2, allow_nan=False)
        f.write("\n")
    if trainer.is_lora:
        trainer.save_adapter(out / "adapter")
        summary["adapter"] = str(out / "adapter")
    else:
        trainer.save_model(out / "model")
        summary["model_out"] = str(out / "model")
    if args.save_base and trainer.is_lora and not with_model:
        trainer.save_model(out / "base")
        summary["base"] = str(out / "base")
    if args.merge:
        trainer.save_merged(out / "merged", overwrite=True)
        summary["merged"] = str(out / "merged")
    if args.plot and losses:
        if plt is None:
            print(
                "nybble train: loss.png skipped: the plot needs matplotlib "
                "(pip install 'nybble[plot]'); everything else is written",
                file=sys.stderr,
            )
        else:
            _plot(plt, losses, evals, args, out / PLOT)
            summary["plot"] = str(out / PLOT)
    if args.json:
        print_json(summary)
    elif losses:
        tail = f", held-out {held_out:.4f}" if held_out is not None else ""
        print(
            f"trained {summary['steps']} steps ({summary['mode']}, {args.device}): loss "
            f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}{tail}; wrote {out}"
        )
    return 0


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 700.0))


def _plot(
    plt: Any,
    losses: list[float],
    evals: list[dict[str, float]],
    args: argparse.Namespace,
    path: Path,
) -> None:
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
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="eval")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per token)")
    mode = "full fine-tuning" if args.full else f"LoRA r={args.lora_r}"
    quant = ", NF4 base" if args.quant == "nf4" else ""
    model = Path(str(args.model)).name if args.model else "built-in model"
    ax.set_title(f"nybble train: {model}, {mode}{quant}, {args.device}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
