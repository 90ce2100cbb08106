"""Whose memory behaviour an estimate models: one `FrameworkModel` per training runtime.

A framework model turns a `TrainingSetup` into the GPU memory of the runtime's steady training
step: the allocated peak of each *phase* of the step (forward, loss, backward, optimizer
step), split into the breakdown's parts, the allocator's cache on top of the step's highest
phase, the process's memory outside the allocator, and the margin that measured runs were
seen to add to such an estimate. `estimate_memory` takes the highest phase. A new runtime
(nybble's own GPU trainer) is one more subclass registered with `register_framework`; nothing
else changes.

`PeftBnb` models transformers + PEFT + bitsandbytes QLoRA (the standard recipe,
docs/estimator.md), with one model of the step: the run's allocations in order (`timeline`),
each tagged with its part, replayed through a simulation of PyTorch's caching allocator
(`replay`, `allocator`) until the training loop's reserved peak stops growing. Every figure of
the estimate comes from that replay; the parts at the peak add up to the allocated peak,
exactly. Both halves were compared with peaks and allocation traces measured on an H100
(benchmarks/memory/, docs/estimator.md). `NybbleTorch` is the same replay with nybble's torch
layer's recipe. Both take several GPUs (`TrainingSetup.strategy`): the timeline of one rank,
with what FSDP or DDP changes (`distributed`), checked against 1- and 2-GPU runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from .allocator import allocation_size, round_size
from .cupy_pool import CupyPool
from .distributed import (
    FsdpTimeline,
    check_supported,
    distributed_notes,
    host_parts,
    nccl_workspace,
    timeline_for,
)
from .parts import BREAKDOWN_KEYS, TENSOR_PARTS
from .quant import FLOAT_FORMATS
from .replay import TaggedReplay, live_peak
from .runtime import DEFAULT_OUTSIDE_ALLOCATOR, HIGHEST_OUTSIDE_ALLOCATOR
from .setup import TrainingSetup
from .timeline import PeftBnbTimeline, Tape
from .trainer_run import (
    ReplayLimitError,
    TrainerRun,
    check_replay_size,
    persistent_bytes,
    step_floor,
)

#: The CUDA caching allocator rounds every block up to this many bytes.
ALLOC_ROUND = 512

#: What the validation run supports adding to a replayed reserved peak (docs/estimator.md):
#: the replay fell short of a measured one by at most one 20 MiB segment (the tiny model at
#: 1024 tokens) and 0.6% (a mixture of experts without checkpointing); every other run's was
#: under 0.1%. The margin covers those: 1% of the reserved peak, at least one such segment.
MARGIN_FRACTION = 0.01
MARGIN_MIN = 20 << 20


def validated_margin(reserved: int, minimum: int = MARGIN_MIN) -> int:
    """`MARGIN_FRACTION` of a reserved peak, at least `minimum`, in whole 2 MiB."""
    step = 2 << 20
    return -(-max(minimum, int(reserved * MARGIN_FRACTION)) // step) * step


def blk(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for a tensor of `nbytes` bytes."""
    return -(-nbytes // ALLOC_ROUND) * ALLOC_ROUND


@dataclass
class Phase:
    """Allocated bytes at the peak of one part of the training step, by breakdown part."""

    name: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class Footprint:
    """A framework model's answer for one setup: the phases of its steady step, the allocator's
    cache on top of the highest one (reserved - allocated at the peak), the process's memory
    outside the allocator (`context`), and `margin`, what the validation run saw the real run
    add to such a figure."""

    phases: list[Phase]
    allocator_cache: int
    context: int
    notes: list[str] = field(default_factory=list)
    details: dict[str, int] = field(default_factory=dict)
    margin: int = 0
    #: the reserved peak of every replayed step (setup first)
    step_reserved: list[int] = field(default_factory=list)
    #: where `context` comes from, when the framework fixes it ("" : the runtime table's)
    context_source: str = ""
    #: what the verdicts count beyond the replayed step (`MemoryEstimate.required_bytes`): a
    #: block the allocator may add from step 2 on that the replay cannot rule out, and the
    #: most the outside part was measured at (0: `context`)
    unruled_block: int = 0
    context_high: int = 0
    #: NCCL's memory outside the allocator (a run on several GPUs), and with CPU offload what
    #: the process keeps in host memory, by breakdown part
    nccl: int = 0
    host: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)


class FrameworkModel(ABC):
    """The memory behaviour of one training runtime."""

    name: ClassVar[str]
    description: ClassVar[str]
    #: the ways of spreading a run over several GPUs it models (`setup.STRATEGIES`)
    strategies: ClassVar[tuple[str, ...]] = ()
    #: what to use instead for several GPUs, when it models none
    instead: ClassVar[str] = ""

    @abstractmethod
    def footprint(self, setup: TrainingSetup) -> Footprint:
        """Phases, allocator cache, outside part and margin of `setup`'s steady step."""

    def lower_bound(self, setup: TrainingSetup) -> int:
        """Bytes the steady step reserves at least (without the outside part), for searches to
        rule out sizes quickly; by default the footprint's own figure."""
        fp = self.footprint(setup)
        return fp.peak.total + fp.allocator_cache


FRAMEWORKS: dict[str, FrameworkModel] = {}


def register_framework(model: FrameworkModel) -> FrameworkModel:
    FRAMEWORKS[model.name] = model
    return model


def get_framework(name: str) -> FrameworkModel:
    key = str(name).strip().lower()
    if key not in FRAMEWORKS:
        known = ", ".join(sorted(FRAMEWORKS))
        raise ValueError(f"unknown framework {name!r} (known: {known})")
    return FRAMEWORKS[key]


class Timeline(Protocol):
    """A run written as replay events: `setup()` then one `step()` per training step."""

    tape: Tape
    steps_done: int

    def setup(self) -> None: ...

    def step(self) -> None: ...


def replay_until_steady(
    timeline: Timeline,
    make_replay: Callable[[dict[int, str], Sequence[str]], TaggedReplay],
    min_steps: int,
    max_steps: int,
) -> TaggedReplay:
    """`timeline`'s setup and steps fed to a replay, step after step, until a step's reserved
    peak equals the one before (at least `min_steps`, at most `max_steps`)."""
    timeline.setup()
    rp = make_replay(timeline.tape.tags, timeline.tape.phases)
    rp.feed(timeline.tape.events)
    timeline.tape.events.clear()  # fed; only the tags are looked up again
    while True:
        timeline.step()
        rp.feed(timeline.tape.events)
        timeline.tape.events.clear()
        n = timeline.steps_done
        if n >= max_steps:
            break
        if n >= min_steps and rp.steps[-1].reserved_peak == rp.steps[-2].reserved_peak:
            break
    return rp


def steady_phases(rp: TaggedReplay) -> list[Phase]:
    """The last replayed step's phases, each its allocated bytes by part at its peak."""
    return [
        Phase(name, {tag: n for tag, n in parts.items() if n})
        for name, (_, parts) in rp.steps[-1].phases.items()
    ]


# --- transformers + PEFT + bitsandbytes ---------------------------------------------------


class PeftBnb(FrameworkModel):
    """transformers + PEFT + bitsandbytes, the recipe of docs/estimator.md.

    What decides its memory (each written into the timeline):
    - `prepare_model_for_kbit_training` casts every non-quantized parameter (embeddings,
      lm_head, norms) to float32, so the residual stream, the attention inputs and the
      logits are float32 even though bitsandbytes computes the matmuls in bf16;
    - with float32 inputs, SDPA's flash kernel is out; the memory-efficient kernel takes
      float32 but not grouped-query attention, so GQA models (Llama 3, Qwen3, Mistral) fall
      to the math backend, which stores the `batch x heads x seq x seq` softmax of every layer;
    - `loss` is float32 cross-entropy over the full vocabulary: log-softmax saved, then its
      gradient and the logits' gradient at the start of backward (3 x tokens x vocab x 4);
    - gradient checkpointing saves each layer's input and recomputes one layer at a time in
      backward;
    - the caching allocator's blocks: what it keeps reserved depends on the whole run's
      order of allocations, so the run is replayed from the model load on, step after step,
      until the reserved peak of a step equals the previous one's (at least `MIN_STEPS`).
    """

    name = "peft-bnb"
    description = "transformers + PEFT + bitsandbytes (prepare_model_for_kbit_training)"
    strategies = ("fsdp", "ddp")

    #: A measurement runs at least 3 steps; the replay as many, then on while still growing.
    MIN_STEPS = 3
    MAX_STEPS = 6

    def timeline(self, s: TrainingSetup) -> PeftBnbTimeline:
        """The events of one GPU's run (of one rank's, on several GPUs)."""
        check_supported(s, self.name)
        return timeline_for(s, self.name)

    def replay(self, s: TrainingSetup) -> TaggedReplay:
        """The run's events replayed until the reserved peak stops growing."""
        return replay_until_steady(self.timeline(s), TaggedReplay, self.MIN_STEPS, self.MAX_STEPS)

    def footprint(self, s: TrainingSetup) -> Footprint:
        timeline = self.timeline(s)
        rp = replay_until_steady(timeline, TaggedReplay, self.MIN_STEPS, self.MAX_STEPS)
        steady = rp.steps[-1]
        phases = steady_phases(rp)
        for phase in phases:
            unknown = set(phase.parts) - set(TENSOR_PARTS)
            if unknown:  # a timeline tag outside the breakdown would be lost from the sum
                raise AssertionError(f"timeline tags {sorted(unknown)} alive in a training step")
        notes: list[str] = distributed_notes(s, self.name)
        if timeline.math:
            notes.append(
                "attention runs on SDPA's math backend (float32 inputs with grouped-query "
                "attention): it stores batch x heads x seq^2 floats per layer"
            )
        if s.arch.is_moe:
            notes += _moe_notes(s)
        reserved = [st.reserved_peak for st in rp.steps]
        if len(reserved) > 2 and reserved[-1] > reserved[2]:
            notes.append(
                f"the caching allocator keeps growing after step 2 ({len(reserved) - 1} steps "
                "replayed): the figure is that of the last one"
            )
        block = unruled_block(reserved, steady.largest_request)
        details = dict(
            steps_replayed=len(rp.steps) - 1,
            segments=rp.allocator.num_segments,
            largest_request=steady.largest_request,
        )
        if s.arch.is_moe:
            details["unquantized_experts"] = unquantized_experts(s)
        host = host_parts(s, timeline) if isinstance(timeline, FsdpTimeline) else {}
        return Footprint(
            phases=phases,
            allocator_cache=steady.reserved_peak - steady.allocated_peak,
            context=DEFAULT_OUTSIDE_ALLOCATOR,
            notes=notes,
            details=details,
            margin=validated_margin(steady.reserved_peak),
            step_reserved=reserved,
            unruled_block=block,
            context_high=HIGHEST_OUTSIDE_ALLOCATOR,
            nccl=nccl_workspace(s.gpus) if s.distributed else 0,
            host=host,
        )

    def lower_bound(self, s: TrainingSetup) -> int:
        """Most bytes alive at once in step 2 (rounded as the allocator rounds them), from the
        same events the replay takes, without the allocator: at most the allocated peak."""
        return live_peak(self.timeline(s).events(steps=2), from_step=2)


def unruled_block(step_reserved: Sequence[int], largest_request: int) -> int:
    """The segment torch's caching allocator adds when, from step 2 on, the step's largest
    tensor (the logits) no longer fits its cached blocks: the optimizer states and the new
    input ids made since step 1 hold them. Whether it does depends on the whole history of the
    run, deterministically: among the same shapes, the validation run's loop reserved it in
    some and not others, and the replay reproduces each of those; a loop that differs in what
    it allocates does otherwise (issue 39: llama-3.2-1b, 1 x 512, checkpointing enabled after
    get_peft_model reserved 2738 MiB in step 1 and 2990 from step 2; the validation run's
    recipe 2740 in every step). So it is counted unless the replay reserves it already:
    0 where the steady step reserves at least that much more than step 1 (`step_reserved`:
    setup first, then steps 1, 2, ...)."""
    block = allocation_size(round_size(largest_request)) if largest_request else 0
    if len(step_reserved) > 2 and step_reserved[-1] - step_reserved[1] >= block:
        return 0
    return block


def _width(s: TrainingSetup) -> int:
    """Bytes of an unquantized weight in training: float32 after the up-cast of a 4-bit run."""
    return 4 if s.quantized else FLOAT_FORMATS[s.quant]


def unquantized_experts(s: TrainingSetup) -> int:
    """Bytes of a mixture of experts' fused expert weights (gate_up_proj, down_proj) in
    training: transformers 5 keeps them as 3-D parameters, which bitsandbytes does not
    quantize, and prepare_model_for_kbit_training makes them float32."""
    shapes = s.arch.expert_shapes()
    per_layer = sum(e * o * i for name, (e, o, i) in shapes.items() if name != "router")
    return s.arch.num_sparse_layers * per_layer * _width(s)


def _moe_notes(s: TrainingSetup) -> list[str]:
    """What an estimate of a mixture of experts rests on (docs/estimator.md)."""
    notes = []
    if s.quantized:
        experts = unquantized_experts(s) / 2**30
        notes.append(
            f"the fused experts are not quantized: transformers 5 keeps them as 3-D parameters, "
            f"which bitsandbytes does not quantize (it quantizes nn.Linear layers), and "
            f"prepare_model_for_kbit_training makes them float32: {experts:.2f} GiB of the "
            f"weights. Left in bfloat16 (no float32 cast of the experts; not modelled) they "
            f"would take {experts / 2:.2f} GiB; a quantization that handles fused experts, or "
            f"several GPUs, takes them further"
        )
    notes += [
        "mixture of experts: the experts run as transformers 5.17's grouped_mm path; the "
        "model was checked on 4 small configurations (Mixtral, Qwen2-MoE, Qwen3-MoE: "
        "-0.6% .. 0.0% of the measured totals), none of them held out"
    ]
    if s.expert_targets:
        width = _width(s)  # the experts' dtype in training
        stack = sum(e * o * i for e, o, i in s.arch.expert_shapes().values()) * width / 2**30
        notes.append(
            f"PEFT's all-linear adapts the fused experts too (router, gate_up_proj at rank "
            f"{s.expert_rank('gate_up_proj')}, down_proj): each sparse layer's forward makes "
            f"W + BA of its experts ({stack:.2f} GiB) and keeps it until its backward"
        )
    return notes


register_framework(PeftBnb())


class NybbleTorch(PeftBnb):
    """transformers + PEFT with nybble's torch layer (`nybble.torch`: `NybbleConfig`,
    `register_lora`), on one GPU, under FSDP2 (`nybble.torch.distributed.shard_model`) or DDP
    (`data_parallel`). Modelled as the PEFT + bitsandbytes replay with what nybble's recipe and
    layer are known to change (`distributed.nybble_torch_recipe`): the model loaded in the
    compute dtype without prepare_model_for_kbit_training's float32 copies; under FSDP2 the
    4-bit weights sharded by rows with their scales and gathered as packed 4-bit data, the LoRA
    parameters gathered in the compute dtype. The layer's own ops are bitsandbytes': W
    dequantized whole in the compute dtype for each product, PEFT's LoRA branch (nybble's fused
    `qlora_linear` is not modelled apart). Not yet measured."""

    name = "nybble-torch"
    description = "transformers + PEFT with nybble's torch layer (nybble.torch; FSDP2, DDP)"


register_framework(NybbleTorch())


# --- nybble's own GPU trainer -------------------------------------------------------------

#: Bytes a process training with nybble on the GPU holds outside CuPy's pool (CUDA context,
#: kernel modules, cuBLAS's workspace): NVML's process memory minus the pool's total right
#: after a step, measured in fresh processes on an H100 (CUDA 13, CuPy 14.2): 594 to 604 MiB
#: over the four development runs of benchmarks/memory/measure_nybble.py (docs/estimator.md).
NYBBLE_OUTSIDE_POOL = 600 << 20
#: The most a measured run of the trainer held beyond its estimate: its outside part, 634 MiB
#: in one held-out run (its reserved peak was exact), so the margin is at least 40 MiB.
NYBBLE_MARGIN_MIN = 40 << 20


class NybbleTrainer(FrameworkModel):
    """nybble's own trainer on the GPU (`nybble.train.Trainer(..., device="cuda")`).

    Its arrays live in CuPy's memory pool, whose reserved bytes follow from the order of every
    allocation and free. The trainer's own code is run on the recording backend
    (`trainer_run.TrainerRun`: the model built from weights that are shapes, then
    `train_batch` steps), and the allocations and frees it records are replayed through
    `CupyPool`, a simulation of CuPy's pool, from the model's construction on, step after
    step, until a step's reserved peak equals the one before. There is no description of the
    trainer here: what decides its memory (the NF4 base dequantized a projection at a time,
    the float32 adapters, gradients and AdamW states in flat buffers, attention and the loss
    in chunks, what each layer keeps for backward with and without checkpointing) is what
    its code allocates (docs/training.md describes it).
    """

    name = "nybble"
    description = "nybble's GPU trainer (nybble.train.Trainer, CuPy)"
    instead = (
        "'nybble-torch' (nybble's torch layer under FSDP2 or DDP) or 'peft-bnb' "
        "(bitsandbytes under FSDP1 or DDP)"
    )

    MIN_STEPS = 3
    MAX_STEPS = 6

    def replay(self, s: TrainingSetup) -> TaggedReplay:
        """The run's events through CuPy's pool until the reserved peak stops growing."""

        def through_cupy_pool(tags: dict[int, str], phases: Sequence[str]) -> TaggedReplay:
            return TaggedReplay(tags, phases, allocator=CupyPool())

        return replay_until_steady(TrainerRun(s), through_cupy_pool, self.MIN_STEPS, self.MAX_STEPS)

    def lower_bound(self, s: TrainingSetup) -> int:
        """At most the step's allocated peak, without running a step: what the trainer's
        construction keeps (recorded once for the model and settings, whatever the batch and
        length), every layer's input (each layer keeps it for its backward, with checkpointing
        or without) and the first chunk of float32 logits of the loss, alive together."""
        check_replay_size(s)
        return persistent_bytes(s) + step_floor(s)

    def footprint(self, s: TrainingSetup) -> Footprint:
        rp = self.replay(s)
        steady = rp.steps[-1]
        phases = steady_phases(rp)
        notes = [
            "nybble's GPU trainer: CuPy's memory pool replayed from the model's construction on; "
            f"the memory outside the pool is the {NYBBLE_OUTSIDE_POOL >> 20} MiB measured on an "
            "H100 (docs/estimator.md)"
        ]
        if not s.quantized:
            notes.append(
                "a dense base: each LoRA layer keeps its own float32 copy of W and, for 16-bit "
                "activations, one in the compute dtype; frozen projections keep the compute dtype"
            )
        return Footprint(
            phases=phases,
            allocator_cache=steady.reserved_peak - steady.allocated_peak,
            context=NYBBLE_OUTSIDE_POOL,
            context_source="measured: nybble's trainer on an H100, CUDA 13, CuPy 14.2",
            notes=notes,
            details=dict(
                steps_replayed=len(rp.steps) - 1,
                segments=rp.allocator.num_segments,
                largest_request=steady.largest_request,
            ),
            margin=validated_margin(steady.reserved_peak, NYBBLE_MARGIN_MIN),
            step_reserved=[st.reserved_peak for st in rp.steps],
        )


register_framework(NybbleTrainer())

__all__ = [
    "BREAKDOWN_KEYS",
    "FRAMEWORKS",
    "NYBBLE_OUTSIDE_POOL",
    "Footprint",
    "FrameworkModel",
    "NybbleTorch",
    "NybbleTrainer",
    "PeftBnb",
    "Phase",
    "ReplayLimitError",
    "blk",
    "get_framework",
    "register_framework",
    "unruled_block",
    "validated_margin",
]
