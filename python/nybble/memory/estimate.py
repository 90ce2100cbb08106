"""`estimate_memory`: will a (Q)LoRA fine-tune fit on a GPU?"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .arch import Architecture
from .frameworks import Footprint, Phase, ReplayLimitError, get_framework
from .parts import (
    ALLOCATOR_CACHE,
    BREAKDOWN_KEYS,
    NCCL_WORKSPACE,
    OUTSIDE_ALLOCATOR,
    TENSOR_PARTS,
)
from .presets import GiB, GpuSpec, parse_bytes, resolve_gpu
from .runtime import outside_allocator
from .setup import ModelLike, TrainingSetup

#: Longest sequence the search tries (2^20 tokens).
MAX_SEQ_LEN = 1 << 20
#: Largest batch the search tries.
MAX_BATCH = 1 << 16

GpuLike = int | float | str | GpuSpec


@dataclass(frozen=True)
class Suggestion:
    """One change to the setup and what it gives (`MemoryEstimate.suggestions`): its
    `total_bytes`, and `required_bytes`, the figure the verdict compares with the GPU."""

    setting: str
    value: Any
    total_bytes: int
    description: str
    required_bytes: int = 0


@dataclass
class MemoryEstimate:
    """GPU memory of a steady training step, as the chosen framework would use it.

    `total_bytes` is the measured figure of docs/estimator.md: the peak the CUDA caching
    allocator reserves during
    a steady step of the training loop, plus the process's memory outside the allocator
    (`context_bytes`: CUDA context and the kernels loaded by then). `breakdown` splits it into
    named parts (docs/estimator.md) that add up to it exactly: the tensors alive at the step's
    allocated peak (`peak_phase`), the allocator's free blocks at that moment, the outside part.
    `allocated_peak_bytes` leaves out the allocator's cached blocks, `reserved_peak_bytes` the
    outside part.

    The verdicts (`fits`, `headroom`, the searches and suggestions) compare `required_bytes`:
    `total_bytes` plus what the replay cannot rule out for a loop other than the modelled one
    (docs/estimator.md): `unruled_block_bytes`, one more block the size of the step's largest
    tensor that the caching allocator may reserve from step 2 on (0 where the replay reserves
    it already), and the outside part at the most it was measured (`context_high_bytes`;
    the given figure when `context` is given). `margin_bytes` covers what the validation
    run's processes held beyond their estimates (1% of the reserved peak, at least 20 MiB):
    `required_bytes + margin_bytes` where even that shortfall matters.

    On several GPUs (`setup.gpus`, `setup.strategy`: docs/estimator.md, "Several GPUs") every
    figure is one GPU's, the one that holds the most; `nccl_bytes` (NCCL's buffers, outside
    the allocator: measured at one and two GPUs) is part of `total_bytes` and of the breakdown, and
    with CPU offload `host_bytes` is what each process keeps in host memory
    (`host_breakdown`, by part), not counted in the GPU's figures.
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
    margin_bytes: int = 0
    context_source: str = ""
    step_reserved_bytes: list[int] = field(default_factory=list)
    gpu: GpuSpec | None = None
    #: the caller's outside-allocator figure, kept for the estimates the searches make
    context_override: int | None = None
    unruled_block_bytes: int = 0
    context_high_bytes: int = 0
    nccl_bytes: int = 0
    host_breakdown: dict[str, int] = field(default_factory=dict)

    @property
    def host_bytes(self) -> int:
        """Host memory each process keeps with CPU offload (0 without)."""
        return sum(self.host_breakdown.values())

    @property
    def required_bytes(self) -> int:
        """The figure the verdicts compare with a GPU: the replayed reserved peak, the block
        the replay cannot rule out, the outside part at the most it was measured, and NCCL's
        buffers on several GPUs."""
        outside = max(self.context_bytes, self.context_high_bytes)
        return self.reserved_peak_bytes + self.unruled_block_bytes + outside + self.nccl_bytes

    # --- the questions --------------------------------------------------------------

    def gpu_bytes(self, gpu: GpuLike | None = None) -> int:
        """Bytes of `gpu` (a size such as `24GB`, bytes, a name such as `rtx4090`), or of the
        GPU the estimate was made for."""
        return self._gpu(gpu).total_bytes

    def _gpu(self, gpu: GpuLike | None) -> GpuSpec:
        if gpu is None:
            if self.gpu is None:
                raise ValueError(
                    "no GPU given: pass one (24GB, bytes, or a name such as rtx4090) or "
                    "estimate with gpu=..."
                )
            return self.gpu
        return gpu if isinstance(gpu, GpuSpec) else resolve_gpu(gpu)

    def fits(self, gpu: GpuLike | None = None) -> bool:
        """True when `required_bytes` is at most the GPU's memory (`24GB`, bytes, `rtx4090`)."""
        return self.required_bytes <= self.gpu_bytes(gpu)

    def fits_with_margin(self, gpu: GpuLike | None = None) -> bool:
        """True when even `required_bytes + margin_bytes` fits."""
        return self.required_bytes + self.margin_bytes <= self.gpu_bytes(gpu)

    def headroom(self, gpu: GpuLike | None = None) -> int:
        """GPU bytes left over at the peak, `required_bytes` counted (negative when it does
        not fit)."""
        return self.gpu_bytes(gpu) - self.required_bytes

    def max_batch(self, gpu: GpuLike | None = None) -> int:
        """Largest batch size (at this seq_len) that fits; 0 when batch 1 does not."""
        return self._largest_fitting(self.gpu_bytes(gpu), lambda b: {"batch": b}, MAX_BATCH)

    def max_seq_len(self, gpu: GpuLike | None = None, multiple_of: int = 1) -> int:
        """Longest sequence (at this batch, a multiple of `multiple_of`) that fits; 0 if none."""
        if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
            raise ValueError(f"multiple_of must be an integer >= 1, got {multiple_of!r}")
        steps = self._largest_fitting(
            self.gpu_bytes(gpu),
            lambda n: {"seq_len": n * multiple_of},
            MAX_SEQ_LEN // multiple_of,
        )
        return steps * multiple_of

    def suggestions(self, gpu: GpuLike | None = None) -> list[Suggestion]:
        """When the setup does not fit: single changes that make it fit, the smallest first
        (checkpointing, double quantization; under FSDP, the embeddings as units of their own,
        CPU offload and twice the GPUs; a
        smaller batch, a shorter sequence, a lower LoRA rank); if none does, checkpointing,
        double quantization and batch 1 with the longest sequence that fits. Empty when it
        fits already, or when nothing makes it fit."""
        limit = self.gpu_bytes(gpu)
        if self.required_bytes <= limit:
            return []
        s, out = self.setup, []

        def suggest(setting: str, value: Any, est: MemoryEstimate, description: str) -> None:
            out.append(Suggestion(setting, value, est.total_bytes, description, est.required_bytes))

        def attempt(setting: str, value: Any, description: str, **changes: Any) -> None:
            try:
                est = self._at(**changes)
            except ReplayLimitError:  # beyond what the framework replays: not suggested
                return
            if est.required_bytes <= limit:
                suggest(setting, value, est, description)

        if not s.grad_checkpointing:
            attempt(
                "grad_checkpointing",
                True,
                "turn gradient checkpointing on",
                grad_checkpointing=True,
            )
        if s.quantized and not s.double_quant:
            attempt("double_quant", True, "use double quantization", double_quant=True)
        if s.strategy == "fsdp":  # several GPUs: the engine's own ways to hold less
            if self.framework == "nybble-torch" and not s.embedding_units and s.arch.lm_head_params:
                attempt(
                    "embedding_units",
                    True,
                    "shard the embeddings and the head as FSDP units of their own "
                    "(shard_model(..., embedding_units=True))",
                    embedding_units=True,
                )
            if not s.offload:
                attempt(
                    "offload",
                    True,
                    "FSDP's CPU offload (shards, gradients and optimizer states in host memory)",
                    offload=True,
                )
            try:
                attempt("gpus", 2 * s.gpus, f"{2 * s.gpus} GPUs", gpus=2 * s.gpus)
            except ValueError:  # the 4-bit weights do not split over that many
                pass
        if s.batch > 1:
            # the largest batch that fits and divides the batch: gradient accumulation over
            # batch / b steps keeps the effective batch (docs/estimator.md)
            top = self.max_batch(limit)
            b = max((d for d in range(1, min(top, s.batch) + 1) if s.batch % d == 0), default=0)
            if b >= 1:
                suggest(
                    "batch",
                    b,
                    self._at(batch=b),
                    f"batch {b} with gradient accumulation over {s.batch // b} steps (the "
                    f"effective batch stays {s.batch})",
                )
        step = seq_len_step(s.seq_len)
        n = self.max_seq_len(limit, multiple_of=step)
        if n >= 1:
            suggest("seq_len", n, self._at(seq_len=n), f"sequences of {n} tokens")
        r = s.lora_r // 2
        while r >= 1:
            est = self._at(lora_r=r)
            if est.required_bytes <= limit:
                suggest("lora_r", r, est, f"LoRA rank {r}")
                break
            r //= 2
        if out:
            return out
        cheap = dict(grad_checkpointing=True, batch=1)
        if s.quantized:
            cheap["double_quant"] = True
        try:
            base = self._at(**cheap)
        except ReplayLimitError:
            return []
        n = base.max_seq_len(limit, multiple_of=step)
        if n >= 1:
            what = (
                "gradient checkpointing, double quantization, batch 1"
                if s.quantized
                else ("gradient checkpointing, batch 1")
            )
            if s.batch > 1:
                what += f" with gradient accumulation over {s.batch} steps"
            suggest(
                "combined",
                dict(cheap, seq_len=n),
                base._at(seq_len=n),
                f"{what} and sequences of {n} tokens",
            )
        return out

    def sweep_seq_len(self, seq_lens: Sequence[int]) -> list[MemoryEstimate]:
        """The same setup at other sequence lengths (for plots)."""
        if isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, Sequence | range):
            raise ValueError(f"seq_lens must be a list of sequence lengths, got {seq_lens!r}")
        return [self._at(seq_len=n) for n in seq_lens]

    def _at(self, **changes: Any) -> MemoryEstimate:
        return _estimate(
            self.setup.with_(**changes), self.framework, self.context_override, self.gpu
        )

    def _largest_fitting(
        self, limit: int, changes: Callable[[int], dict[str, Any]], hi: int
    ) -> int:
        """Largest n in [1, hi] whose setup with `changes(n)` fits in `limit` bytes. The
        framework's lower bound (for transformers + PEFT + bitsandbytes: the replay's events
        without the allocator) narrows the range; then a few full estimates finish."""
        model = get_framework(self.framework)
        beyond: set[int] = set()  # sizes the framework does not replay (ReplayLimitError)

        def lower(n: int) -> int:
            try:
                setup = self.setup.with_(**changes(n))
                return model.lower_bound(setup) + self.context_bytes + self.nccl_bytes
            except ReplayLimitError:
                beyond.add(n)
                return limit + 1  # counted as not fitting: the answer is a lower bound

        def total(n: int) -> int:
            return self._at(**changes(n)).required_bytes

        top = _largest(lambda n: lower(n) <= limit, hi)
        found = _largest_within(total, limit, top)
        if found and found + 1 in beyond:
            (setting, value), *_ = changes(found).items()
            note = (
                f"the search for the largest {setting} stopped at {value}: framework "
                f"{self.framework!r} replays no larger one here; a larger one may fit too"
            )
            if note not in self.notes:
                self.notes.append(note)
        return found

    # --- output ---------------------------------------------------------------------

    @property
    def architecture(self) -> Architecture:
        return self.setup.arch

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB

    def to_dict(self) -> dict[str, Any]:
        s = self.setup
        out: dict[str, Any] = dict(
            model=s.arch.name,
            framework=self.framework,
            settings=dict(
                quant=s.quant,
                blocksize=s.blocksize,
                double_quant=s.double_quant,
                lora_r=s.lora_r,
                targets=list(s.targets),
                expert_targets=list(s.expert_targets),
                lora_dtype=s.lora_dtype,
                lora_dropout=s.lora_dropout,
                optimizer=s.optimizer,
                batch=s.batch,
                seq_len=s.seq_len,
                grad_checkpointing=s.grad_checkpointing,
                compute_dtype=s.compute_dtype,
                loop=s.loop,
                gpus=s.gpus,
                strategy=s.strategy,
                offload=s.offload,
                embedding_units=s.embedding_units,
            ),
            parameters=s.arch.num_parameters,
            lora_parameters=s.lora_parameters,
            total_bytes=self.total_bytes,
            reserved_peak_bytes=self.reserved_peak_bytes,
            allocated_peak_bytes=self.allocated_peak_bytes,
            context_bytes=self.context_bytes,
            context_source=self.context_source,
            margin_bytes=self.margin_bytes,
            required_bytes=self.required_bytes,
            unruled_block_bytes=self.unruled_block_bytes,
            context_high_bytes=self.context_high_bytes,
            nccl_bytes=self.nccl_bytes,
            host_bytes=self.host_bytes,
            host_breakdown=dict(self.host_breakdown),
            breakdown=dict(self.breakdown),
            peak_phase=self.peak_phase,
            phases=dict(self.phases),
            step_reserved_bytes=list(self.step_reserved_bytes),
            notes=list(self.notes),
        )
        if self.gpu is not None:
            out["gpu"] = dict(
                name=self.gpu.name,
                label=self.gpu.label,
                bytes=self.gpu.total_bytes,
                fits=self.fits(),
                fits_with_margin=self.fits_with_margin(),
                headroom_bytes=self.headroom(),
            )
        return out

    def __repr__(self) -> str:
        s = self.setup
        gpus = f", gpus={s.gpus}, strategy={s.strategy!r}" if s.distributed else ""
        return (
            f"MemoryEstimate({s.arch.name!r}, total={self.total_gib:.2f} GiB"
            f"{' per GPU' if s.distributed else ''}, batch={s.batch}, seq_len={s.seq_len}, "
            f"framework={self.framework!r}{gpus})"
        )


def seq_len_step(seq_len: int) -> int:
    """The multiple sequence lengths are searched in: 64 (a round length, and the searches
    stay quick) unless the setup's own is shorter."""
    return 64 if seq_len >= 64 else 1


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


def _estimate(
    setup: TrainingSetup,
    framework: str,
    context: int | None = None,
    gpu: GpuSpec | None = None,
) -> MemoryEstimate:
    model = get_framework(framework)
    if setup.distributed and setup.strategy not in model.strategies:
        what = f"gpus={setup.gpus}, strategy={setup.strategy!r}"
        if setup.offload:
            what += ", offload=True"
        if model.instead:
            raise ValueError(
                f"framework {model.name!r} ({model.description}) runs on one GPU; for {what} "
                f"use framework={model.instead}"
            )
        known = ", ".join(model.strategies) or "none"
        raise ValueError(
            f"framework {model.name!r} does not model {what} (its strategies: {known})"
        )
    fp: Footprint = model.footprint(setup)
    peak: Phase = fp.peak
    unknown = set(peak.parts) - set(TENSOR_PARTS)
    if unknown:
        raise ValueError(f"framework {model.name!r} reports unknown parts {sorted(unknown)}")
    allocated = peak.total
    reserved = allocated + fp.allocator_cache
    if context is None:
        context_bytes = fp.context
        source = fp.context_source or outside_allocator(gpu.generation if gpu else None).source
    else:
        context_bytes, source = context, "given"
    notes = list(fp.notes)
    high = fp.context_high if context is None else 0
    extra = [
        f"one more block the size of the step's largest tensor ({fp.unruled_block / GiB:.2f} "
        "GiB), which torch's caching allocator reserves from step 2 on in some training loops: "
        "the replayed one does not, but that does not rule it out for yours (docs/estimator.md)"
    ] * bool(fp.unruled_block)
    if high > context_bytes:
        extra.append(f"the memory outside the allocator at the most measured, {high >> 20} MiB")
    if extra:
        notes.append("the verdicts count, beyond the total: " + "; and ".join(extra))
    breakdown = {k: peak.parts.get(k, 0) for k in TENSOR_PARTS}
    breakdown[ALLOCATOR_CACHE] = fp.allocator_cache
    breakdown[OUTSIDE_ALLOCATOR] = context_bytes
    breakdown[NCCL_WORKSPACE] = fp.nccl
    assert tuple(breakdown) == BREAKDOWN_KEYS
    return MemoryEstimate(
        setup=setup,
        framework=model.name,
        total_bytes=reserved + context_bytes + fp.nccl,
        allocated_peak_bytes=allocated,
        reserved_peak_bytes=reserved,
        context_bytes=context_bytes,
        breakdown=breakdown,
        peak_phase=peak.name,
        phases={p.name: p.total for p in fp.phases},
        notes=notes,
        details=dict(fp.details),
        margin_bytes=fp.margin,
        context_source=source,
        step_reserved_bytes=list(fp.step_reserved),
        gpu=gpu,
        context_override=context,
        unruled_block_bytes=fp.unruled_block,
        context_high_bytes=high,
        nccl_bytes=fp.nccl,
        host_breakdown=dict(fp.host),
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
    loop: str = "plain",
    context: int | str | None = None,
    gpu: GpuLike | None = None,
    gpus: int = 1,
    strategy: str | None = None,
    offload: bool = False,
    embedding_units: bool = False,
) -> MemoryEstimate:
    """GPU memory of a steady (Q)LoRA training step (docs/estimator.md).

    `model`: a preset name (`nybble.memory.MODEL_PRESETS`), a path to a Hugging Face
    `config.json` (or its folder), a Hub id whose config is in the local Hugging Face cache
    (`Qwen/Qwen3-4B`), a config dict, or an `Architecture`. `quant`: the base weights' format
    (nf4, fp4, int8, or bfloat16/float16/float32 for plain LoRA). `targets`: "all-linear" or
    projection names (q_proj, ..., down_proj). `framework`: whose memory behaviour to model
    ("peft-bnb": transformers + PEFT + bitsandbytes). `loop`: "plain" (the standard training loop)
    or "benchmark" (benchmarks/memory/measure_peft_bnb.py's). `context`: the process's memory
    outside torch's allocator, if you measured it (bytes or a size such as "751MiB"); by
    default the runtime's figure (`nybble.memory.runtime`). `gpu`: the GPU to answer for (a
    name such as "rtx4090" or a size such as "24GB"): `fits()`, `max_batch()` and the others
    then need no argument, and `to_dict()` says whether it fits.

    Several GPUs (docs/estimator.md, "Several GPUs"; checked on 1 and 2 GPUs): `gpus` GPUs
    spread by `strategy`, "fsdp" (the default when gpus > 1 or offload: FSDP2 for
    "nybble-torch", FSDP1 with a storage dtype for "peft-bnb") or "ddp" (a whole replica on
    each); `offload`: FSDP's CPU offload (host memory in `host_bytes`); `embedding_units`:
    FSDP2 with the embeddings and the head as units of their own (`shard_model(...,
    embedding_units=True)`; framework "nybble-torch"). The estimate is then
    per GPU, with the same breakdown (plus the gathered parameters, the communication buffers
    and NCCL's workspace) and the same verdicts for one GPU of that size. framework="nybble"
    (nybble's own trainer) runs on one GPU only. Given a strategy, one GPU is that runtime on
    one GPU (torchrun with one process).

    Raises ValueError on bad input (FormatError, a ValueError, for a bad config file).
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
        loop=loop,
        gpus=gpus,
        strategy=strategy,
        offload=offload,
        embedding_units=embedding_units,
    )
    spec = None if gpu is None else (gpu if isinstance(gpu, GpuSpec) else resolve_gpu(gpu))
    outside = None if context is None else parse_bytes(context, "context", minimum=0)
    return _estimate(setup, framework, outside, spec)
