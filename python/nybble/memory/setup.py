"""The normalized inputs of an estimate: one training setup, validated once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .arch import PROJECTIONS, Architecture
from .presets import MODEL_PRESETS
from .quant import QUANTIZED_FORMATS, check_blocksize, normalize_dtype, normalize_format

#: The training loops an estimate can model (memory.timeline says how they differ): "plain",
#: SPEC §5's loop (new input ids each step, labels = the ids, no attention mask, no KV cache),
#: and "benchmark", the step loop of benchmarks/memory/measure_peft_bnb.py --loop benchmark.
LOOPS = ("plain", "benchmark")

#: Optimizers whose state the estimate knows.
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
_OPTIMIZER_ALIASES = {
    "adam": "adamw",
    "adamw_torch": "adamw",
    "adamw-8bit": "adamw8bit",
    "adamw_8bit": "adamw8bit",
    "adamw_bnb_8bit": "adamw8bit",
    "paged_adamw_8bit": "adamw8bit",
}

ModelLike = str | Path | Mapping[str, Any] | Architecture


def optimizer_states(optimizer: str, elems: int, pbytes: int) -> list[int]:
    """Bytes of each optimizer-state tensor kept for one parameter of `elems` elements."""
    if optimizer == "adamw":
        return [elems * pbytes] * 2  # exp_avg, exp_avg_sq
    if optimizer == "adamw8bit":
        # bitsandbytes: uint8 states with one float32 absmax per 256 values for tensors of
        # at least 4096 elements; smaller ones keep 32-bit states
        if elems >= 4096:
            return [elems, 4 * -(-elems // 256)] * 2
        return [4 * elems] * 2
    return []  # SGD without momentum


def optimizer_temporaries(optimizer: str, elems: int, pbytes: int) -> list[int]:
    """Bytes of each temporary the optimizer step makes for one parameter of `elems` elements:
    torch's foreach AdamW takes the square root of the second moments into a new list."""
    return [elems * pbytes] if optimizer == "adamw" else []


def resolve_model(model: ModelLike) -> Architecture:
    """A preset name, a path to an HF `config.json` (or its folder), a config dict, or an
    `Architecture`."""
    if isinstance(model, Architecture):
        return model
    if isinstance(model, Mapping):
        return Architecture.from_config(model)
    if isinstance(model, (str, Path)):
        key = str(model).strip().lower()
        if key in MODEL_PRESETS:
            return Architecture.from_config(MODEL_PRESETS[key], name=key)
        path = Path(model)
        if path.exists() or str(model).endswith(".json") or "/" in str(model):
            return Architecture.from_json(path)
        known = ", ".join(sorted(MODEL_PRESETS))
        raise ValueError(
            f"unknown model {str(model)!r}: not a preset or a config.json path (presets: {known})"
        )
    raise ValueError(
        f"model must be a preset name, a config.json path or a dict, got {type(model).__name__}"
    )


def resolve_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
    """PEFT's `target_modules`: "all-linear" (every projection but lm_head) or a list of names."""
    if isinstance(targets, str):
        key = targets.strip().lower()
        if key in ("all-linear", "all_linear", "all"):
            return PROJECTIONS
        if key in ("attention", "attn"):
            return PROJECTIONS[:4]
        if key == "mlp":
            return PROJECTIONS[4:]
        names = [t.strip() for t in targets.split(",") if t.strip()]
    else:
        names = [str(t).strip() for t in targets]
    if not names:
        raise ValueError("targets must name at least one projection (or be 'all-linear')")
    out: list[str] = []
    for name in names:
        short = name.rsplit(".", 1)[-1]
        if short not in PROJECTIONS:
            raise ValueError(
                f"unknown LoRA target {name!r} (known: all-linear, {', '.join(PROJECTIONS)})"
            )
        if short not in out:
            out.append(short)
    return tuple(t for t in PROJECTIONS if t in out)


def _loop(loop: str) -> str:
    key = str(loop).strip().lower()
    if key not in LOOPS:
        raise ValueError(f"unknown training loop {loop!r} (known: {', '.join(LOOPS)})")
    return key


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class TrainingSetup:
    """Everything an estimate depends on, validated. Make one with `TrainingSetup.create`."""

    arch: Architecture
    quant: str
    blocksize: int
    double_quant: bool
    lora_r: int
    targets: tuple[str, ...]
    lora_dtype: str
    lora_dropout: float
    optimizer: str
    batch: int
    seq_len: int
    grad_checkpointing: bool
    compute_dtype: str
    loop: str = "plain"

    @property
    def quantized(self) -> bool:
        return self.quant in QUANTIZED_FORMATS

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def lora_tensors(self) -> list[int]:
        """Element counts of every LoRA tensor: A then B of each target, layer by layer."""
        shapes = self.arch.linear_shapes()
        per_layer: list[int] = []
        for t in self.targets:
            out_f, in_f = shapes[t]
            per_layer += [self.lora_r * in_f, out_f * self.lora_r]
        return per_layer * self.arch.num_layers

    @classmethod
    def create(
        cls,
        model: ModelLike,
        *,
        quant: str = "nf4",
        blocksize: int = 64,
        double_quant: bool = True,
        lora_r: int = 16,
        targets: str | Sequence[str] = "all-linear",
        lora_dtype: str = "float32",
        lora_dropout: float = 0.0,
        optimizer: str = "adamw",
        batch: int = 1,
        seq_len: int = 2048,
        grad_checkpointing: bool = True,
        compute_dtype: str = "bfloat16",
        loop: str = "plain",
    ) -> TrainingSetup:
        arch = resolve_model(model)
        fmt = normalize_format(quant)
        r = _positive_int(lora_r, "lora_r")
        tgt = resolve_targets(targets)
        shapes = arch.linear_shapes()
        for t in tgt:
            if r > min(shapes[t]):
                raise ValueError(f"lora_r {r} exceeds min(in, out) = {min(shapes[t])} of {t}")
        if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)):
            raise ValueError(f"lora_dropout must be a number in [0, 1), got {lora_dropout!r}")
        if not 0.0 <= float(lora_dropout) < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {lora_dropout}")
        opt = str(optimizer).strip().lower()
        opt = _OPTIMIZER_ALIASES.get(opt, opt)
        if opt not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r} (known: {', '.join(OPTIMIZERS)})")
        return cls(
            arch=arch,
            quant=fmt,
            blocksize=check_blocksize(blocksize) if fmt in QUANTIZED_FORMATS else blocksize,
            double_quant=bool(double_quant) and fmt in QUANTIZED_FORMATS,
            lora_r=r,
            targets=tgt,
            lora_dtype=normalize_dtype(lora_dtype, "lora_dtype"),
            lora_dropout=float(lora_dropout),
            optimizer=opt,
            batch=_positive_int(batch, "batch"),
            seq_len=_positive_int(seq_len, "seq_len"),
            grad_checkpointing=bool(grad_checkpointing),
            compute_dtype=normalize_dtype(compute_dtype, "compute_dtype"),
            loop=_loop(loop),
        )

    def with_(self, **changes: Any) -> TrainingSetup:
        if "batch" in changes:
            _positive_int(changes["batch"], "batch")
        if "seq_len" in changes:
            _positive_int(changes["seq_len"], "seq_len")
        return replace(self, **changes)
