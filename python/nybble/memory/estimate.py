"""`estimate_memory`: will a (Q)LoRA fine-tune fit on a GPU?"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .arch import Architecture
from .frameworks import BREAKDOWN_KEYS, Footprint, Phase, get_framework
from .presets import GiB, parse_size
from .setup import ModelLike, TrainingSetup

#: Longest sequence the search tries (2^20 tokens).
MAX_SEQ_LEN = 1 << 20
#: Largest batch the search tries.
MAX_BATCH = 1 << 16


@dataclass
class MemoryEstimate:
    """Peak GPU memory of one training step, as the chosen framework would use it.

    `total_bytes` is what SPEC §5 measures: the peak reserved by the CUDA caching allocator
    during a steady-state step plus the CUDA context. `allocated_peak_bytes` leaves out the
    allocator's cached blocks; `reserved_peak_bytes` leaves out the context. `breakdown` splits
    `total_bytes` into named parts, as they stand at the peak moment (`peak_phase`).
    """

    setup: TrainingSetup
    framework: str
    total_bytes: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    context_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    phases: dict[str, int]
    notes: list[str] = field(default_factory=list)
    details: dict[str, int] = field(default_factory=dict)

    # --- the questions --------------------------------------------------------------

    def fits(self, gpu_bytes: int | str) -> bool:
        """True when `total_bytes` is at most the GPU's memory (bytes, `24GiB`, `rtx4090`)."""
        return self.total_bytes <= parse_size(gpu_bytes)

    def headroom(self, gpu_bytes: int | str) -> int:
        """GPU bytes left over at the peak (negative when it does not fit)."""
        return parse_size(gpu_bytes) - self.total_bytes

    def max_batch(self, gpu_bytes: int | str) -> int:
        """Largest batch size (at this seq_len) that fits; 0 when batch 1 does not."""
        return self._largest_fitting(parse_size(gpu_bytes), lambda b: {"batch": b}, MAX_BATCH)

    def max_seq_len(self, gpu_bytes: int | str, multiple_of: int = 1) -> int:
        """Longest sequence (at this batch, a multiple of `multiple_of`) that fits; 0 if none."""
        if multiple_of < 1:
            raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
        steps = self._largest_fitting(
            parse_size(gpu_bytes),
            lambda n: {"seq_len": n * multiple_of},
            MAX_SEQ_LEN // multiple_of,
        )
        return steps * multiple_of

    def sweep_seq_len(self, seq_lens: Sequence[int]) -> list[MemoryEstimate]:
        """The same setup at other sequence lengths (for plots)."""
        return [self._at(seq_len=n) for n in seq_lens]

    def _at(self, **changes: Any) -> MemoryEstimate:
        return _estimate(self.setup.with_(**changes), self.framework)

    def _largest_fitting(
        self, limit: int, changes: Callable[[int], dict[str, Any]], hi: int
    ) -> int:
        """Largest n in [1, hi] whose setup with `changes(n)` fits in `limit` bytes. The
        framework's quick footprint (for transformers + PEFT + bitsandbytes: without the
        allocator's cache, so no replay) bounds the total from below and narrows the range;
        then a few full estimates finish."""

        def total(n: int, quick: bool = False) -> int:
            setup = self.setup.with_(**changes(n))
            return _estimate(setup, self.framework, quick).total_bytes

        top = _largest(lambda n: total(n, quick=True) <= limit, hi)
        return _largest_within(total, limit, top)

    # --- output ---------------------------------------------------------------------

    @property
    def architecture(self) -> Architecture:
        return self.setup.arch

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB

    def to_dict(self) -> dict[str, Any]:
        s = self.setup
        return dict(
            model=s.arch.name,
            framework=self.framework,
            settings=dict(
                quant=s.quant,
                blocksize=s.blocksize,
                double_quant=s.double_quant,
                lora_r=s.lora_r,
                targets=list(s.targets),
                lora_dtype=s.lora_dtype,
                lora_dropout=s.lora_dropout,
                optimizer=s.optimizer,
                batch=s.batch,
                seq_len=s.seq_len,
                grad_checkpointing=s.grad_checkpointing,
                compute_dtype=s.compute_dtype,
            ),
            parameters=s.arch.num_parameters,
            lora_parameters=s.arch.lora_parameters(s.lora_r, s.targets),
            total_bytes=self.total_bytes,
            reserved_peak_bytes=self.reserved_peak_bytes,
            allocated_peak_bytes=self.allocated_peak_bytes,
            context_bytes=self.context_bytes,
            breakdown=dict(self.breakdown),
            peak_phase=self.peak_phase,
            phases=dict(self.phases),
            notes=list(self.notes),
        )

    def __repr__(self) -> str:
        return (
            f"MemoryEstimate({self.setup.arch.name!r}, total={self.total_gib:.2f} GiB, "
            f"batch={self.setup.batch}, seq_len={self.setup.seq_len}, "
            f"framework={self.framework!r})"
        )


def _largest(ok: Callable[[int], bool], hi: int) -> int:
    """Largest n in [1, hi] with ok(n), assuming ok is monotone; 0 when ok(1) is false."""
    if not ok(1):
        return 0
    lo, n = 1, 2
    while n <= hi and ok(n):
        lo, n = n, n * 2
    top = min(n, hi + 1)  # ok(top) is false or top is past the range
    while top - lo > 1:
        mid = (lo + top) // 2
        if ok(mid):
            lo = mid
        else:
            top = mid
    return lo


def _largest_within(total: Callable[[int], int], limit: int, top: int) -> int:
    """Largest n in [1, top] with total(n) <= limit (0 if none), for a total that grows with
    n and is costly to evaluate: interpolation inside the bracket [fits, does not fit),
    bisection whenever a step fails to halve it."""
    if top < 1:
        return 0
    t_bad = total(top)
    if t_bad <= limit:
        return top
    t_good = total(1) if top > 1 else t_bad
    if t_good > limit:
        return 0
    good, bad, halve = 1, top, False
    while bad - good > 1:
        width = bad - good
        if halve:
            n = (good + bad) // 2
        else:
            n = good + (limit - t_good) * width // max(t_bad - t_good, 1)
            n = min(max(n, good + 1), bad - 1)
        t = total(n)
        if t <= limit:
            good, t_good = n, t
        else:
            bad, t_bad = n, t
        halve = 2 * (bad - good) > width
    return good


def _estimate(setup: TrainingSetup, framework: str, quick: bool = False) -> MemoryEstimate:
    model = get_framework(framework)
    fp: Footprint = model.quick_footprint(setup) if quick else model.footprint(setup)
    peak: Phase = fp.peak
    allocated = peak.total
    reserved = allocated + fp.allocator_cache
    total = reserved + fp.context
    breakdown = {k: peak.parts.get(k, 0) for k in BREAKDOWN_KEYS}
    breakdown["runtime_overhead"] += fp.allocator_cache + fp.context
    details = dict(fp.details, allocator_cache=fp.allocator_cache, cuda_context=fp.context)
    return MemoryEstimate(
        setup=setup,
        framework=model.name,
        total_bytes=total,
        allocated_peak_bytes=allocated,
        reserved_peak_bytes=reserved,
        context_bytes=fp.context,
        breakdown=breakdown,
        peak_phase=peak.name,
        phases={p.name: p.total + fp.allocator_cache + fp.context for p in fp.phases},
        notes=fp.notes,
        details=details,
    )


def estimate_memory(
    model: ModelLike,
    *,
    quant: str = "nf4",
    blocksize: int = 64,
    double_quant: bool = True,
    lora_r: int = 16,
    targets: str | Sequence[str] = "all-linear",
    lora_dtype: str = "float32",
    optimizer: str = "adamw",
    batch: int = 1,
    seq_len: int = 2048,
    grad_checkpointing: bool = True,
    compute_dtype: str = "bfloat16",
    framework: str = "peft-bnb",
    lora_dropout: float = 0.0,
) -> MemoryEstimate:
    """Peak GPU memory of a (Q)LoRA training step (SPEC §5).

    `model`: a preset name (`nybble.memory.MODEL_PRESETS`), a path to a Hugging Face
    `config.json` (or its folder), a config dict, or an `Architecture`. `quant`: the base
    weights' format (nf4, fp4, int8, or bfloat16/float16/float32 for plain LoRA). `targets`:
    "all-linear" or projection names (q_proj, ..., down_proj). `framework`: whose memory
    behaviour to model ("peft-bnb": transformers + PEFT + bitsandbytes).

    Raises ValueError (or KeyError-free ValueError for unknown names) on bad input.
    """
    setup = TrainingSetup.create(
        model,
        quant=quant,
        blocksize=blocksize,
        double_quant=double_quant,
        lora_r=lora_r,
        targets=targets,
        lora_dtype=lora_dtype,
        lora_dropout=lora_dropout,
        optimizer=optimizer,
        batch=batch,
        seq_len=seq_len,
        grad_checkpointing=grad_checkpointing,
        compute_dtype=compute_dtype,
    )
    return _estimate(setup, framework)
