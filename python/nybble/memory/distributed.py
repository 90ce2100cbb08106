"""What several GPUs change in a training run's memory, per GPU: FSDP and DDP written into the
replayed timeline (docs/estimator.md, "Several GPUs").

A per-GPU estimate is the single-GPU replay of what one rank allocates: the same ops of the
step (`timeline.PeftBnbTimeline`), the same simulation of torch's caching allocator, the same
tagged breakdown, with what the engine changes:

- **FSDP2** (`nybble.torch.distributed.shard_model`, framework "nybble-torch"): `fully_shard`
  on every decoder layer and on the root. Each parameter is sharded along dim 0, padded to
  `ceil(rows / gpus)` rows on every GPU; a 4-bit weight (`NF4Weight`) by rows, each rank
  keeping the codes, scales and nested scales of the blocks its rows touch
  (`nf4_shard`: nybble/torch/_packed.py's spans), and all-gathered as those packed arrays,
  never in 16 bits. A layer's unshard is one all-gather of every parameter's shard (the LoRA
  ones cast to the compute dtype: `MixedPrecisionPolicy(param_dtype=...)`) into one flat
  buffer, which FSDP2 holds until the next all-gather, copied out into each parameter's
  unsharded tensors, which live until the layer is resharded (after its forward, and after
  its backward). In backward the next layer is prefetched: its flat buffer is gathered while
  the current one computes. The root (embeddings, final norm, head) is not resharded after the
  forward: it stays gathered until the backward ends. After a layer's backward its LoRA
  gradients (in the compute dtype) are reduce-scattered in float32 (`reduce_dtype`): one flat
  input of every gradient padded (held until the next reduce-scatter), one output that becomes
  the sharded gradients, kept until `zero_grad`. The optimizer's states are those of the
  shards.
- **FSDP1** (`FullyShardedDataParallel`, framework "peft-bnb"): one flat parameter per decoder
  layer and one for the root, `use_orig_params=True`. FSDP1 flattens a unit in one dtype, so
  bitsandbytes stores its packed codes in a float dtype (`bnb_4bit_quant_storage`) and the
  LoRA and other parameters must be in it too: the storage dtype is `lora_dtype`, and the
  unquantized weights and the residual stream are in it (no `prepare_model_for_kbit_training`
  cast, which would mix dtypes in a unit). The quantization constants are not parameters
  (bitsandbytes keeps them in the weight's quant state): they stay whole on every GPU. Each
  parameter starts at a multiple of 16 bytes in the flat parameter, whose length is padded to
  a multiple of the GPUs; a rank holds `length / gpus` elements. A layer's flat parameter is
  gathered whole in the storage dtype for its forward, and again for its backward with the
  next one prefetched (`BACKWARD_PRE`); the root stays gathered from the forward to the end of
  the backward. With frozen and trainable parameters in one flat parameter the gradient is the
  flat parameter's whole size (the frozen codes' share is zeros), reduce-scattered into a
  shard of the flat parameter's, kept until `zero_grad` (torch's FSDP1 documentation warns of
  this). With one GPU FSDP1 does not shard (`NO_SHARD`): no all-gathers, and the whole flat
  gradient is the gradient.
- **DDP** (either framework): a whole replica, loaded as on one GPU, plus the gradient
  buckets of the trainable (LoRA) parameters: flat tensors of up to `DDP_BUCKET_CAP` (the first
  `DDP_FIRST_BUCKET`), made when DDP wraps the model and made again, in the order the
  gradients became ready, at the second step's forward.
- **offload** (FSDP's CPU offload): the shards, the sharded gradients and the optimizer's
  states live in host memory (`host_parts`); each unshard first copies the rank's shards to
  the GPU, and each sharded gradient is copied back to the host.
- NCCL's own buffers (`nccl_workspace`) are outside torch's allocator: measured at one and two
  GPUs, counted once per process.

Allocations on FSDP's side streams (the all-gather's flat buffers, the reduce-scatter's) are
replayed on streams of their own, whose cached blocks torch's allocator keeps apart. The
model load is a low-memory one (each rank holds only its shards when training starts:
`load_sharded` for nybble, FSDP's `sync_module_states` for bitsandbytes), but for the root's
unquantized weights and the LoRA parameters, which are made whole on every rank before they
are sharded.

Measured (benchmarks/fsdp_gpu.py, 8 layers of the Llama-3.1-70B shape, 2048 tokens, H200s;
docs/multi-gpu.md): nybble-torch's reserved and allocated peaks within 0.4% at one and two
GPUs. peft-bnb's allocated peak within 0.6%, its reserved peak 32-38% under: that run loads
the whole model on every rank (transformers' `device_map`, with its warm-up block of the
model's size) and FSDP1 then flattens each unit into new tensors, and its gradients land on
FSDP1's unshard stream; the cached segments that load leaves are not the low-memory load
modelled here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from .arch import ATTENTION_PROJECTIONS
from .parts import (
    COMM_BUFFERS,
    GATHERED_PARAMS,
    GRADIENTS,
    LORA_PARAMS,
    OPTIMIZER_STATES,
    QUANT_CONSTANTS,
    QUANTIZED_WEIGHTS,
    UNQUANTIZED_WEIGHTS,
)
from .presets import MiB
from .quant import FLOAT_FORMATS, NESTED_BLOCKSIZE, stored_weight
from .setup import TrainingSetup, optimizer_states, optimizer_temporaries
from .timeline import PeftBnbTimeline, Recipe

#: NCCL's memory outside torch's caching allocator, per process (its communicators' buffers
#: and kernels), by the GPUs of the run: measured by benchmarks/fsdp_gpu.py on H200s (torch
#: 2.11, CUDA 13) as NVML's process memory minus `memory_reserved()` minus the single-GPU
#: outside part (runtime.py's 742 MiB), the same on both sides: 1318 MiB with one GPU, 1600
#: with two. More GPUs are not measured: they take the two-GPU figure (a ring has two peers
#: whatever its size; NVLink SHARP buffers, which take more, are not counted).
NCCL_WORKSPACE_MEASURED = {1: 576 * MiB, 2: 858 * MiB}
NCCL_WORKSPACE = NCCL_WORKSPACE_MEASURED[2]


def nccl_workspace(gpus: int) -> int:
    """NCCL's bytes outside the allocator in a process of a run over `gpus` GPUs."""
    return NCCL_WORKSPACE_MEASURED.get(gpus, NCCL_WORKSPACE)


#: DDP's gradient buckets: `bucket_cap_mb` (25 MiB by default) and the first bucket's cap
#: (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`).
DDP_BUCKET_CAP = 25 * MiB
DDP_FIRST_BUCKET = 1 * MiB

#: FSDP1 with `use_orig_params=True` starts each parameter at a multiple of this many bytes.
FSDP1_ALIGN = 16

#: FSDP2's reduce-scatter dtype (`MixedPrecisionPolicy(reduce_dtype=torch.float32)`).
REDUCE_WIDTH = 4

#: The replay's streams: FSDP's all-gathers and reduce-scatters allocate on their own.
DEFAULT_STREAM, GATHER_STREAM, REDUCE_STREAM = 0, 1, 2

#: The timeline's keys of the units that are not decoder layers: the root, and with
#: `embedding_units` the input and the output embeddings.
ROOT, EMBEDDINGS, HEAD = -1, -2, -3

#: The engine behind each strategy, per framework.
ENGINES = {
    ("nybble-torch", "fsdp"): "FSDP2 (fully_shard per decoder layer and the root)",
    ("peft-bnb", "fsdp"): "FSDP1 (a flat parameter per decoder layer and the root)",
    ("nybble-torch", "ddp"): "DDP (nybble.torch.data_parallel)",
    ("peft-bnb", "ddp"): "DDP",
}


# --- the recipes ----------------------------------------------------------------------------


def peft_bnb_recipe(s: TrainingSetup) -> Recipe:
    """transformers + PEFT + bitsandbytes: the single-GPU recipe, under DDP too; under FSDP1
    every parameter of a unit in one dtype, the storage dtype (`lora_dtype`): the codes
    stored as it (`bnb_4bit_quant_storage`), the unquantized weights loaded in it and never
    up-cast, the residual stream in it."""
    if s.strategy != "fsdp":
        return Recipe.standard(s)
    w = FLOAT_FORMATS[s.lora_dtype]
    return Recipe(load=w, upcast=False, residual=w, lora=w, lora_compute=w, cast_logits=w != 4)


def nybble_torch_recipe(s: TrainingSetup) -> Recipe:
    """transformers + PEFT with nybble's torch layer (docs/torch.md, docs/multi-gpu.md): the
    model loaded in the compute dtype, no prepare_model_for_kbit_training (the unquantized
    weights and the residual stream stay in it), the LoRA parameters in `lora_dtype`; under
    FSDP2 they are gathered and computed in the compute dtype (mixed precision)."""
    c = FLOAT_FORMATS[s.compute_dtype]
    lora = FLOAT_FORMATS[s.lora_dtype]
    compute = c if s.strategy == "fsdp" else lora
    return Recipe(
        load=c, upcast=False, residual=c, lora=lora, lora_compute=compute, cast_logits=c != 4
    )


# --- what a unit holds ----------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One parameter as an engine shards it: `rows` along dim 0, `cols` elements a row,
    `width` bytes an element as stored, `gather_width` as gathered (mixed precision); `nf4`
    marks nybble's 4-bit weight W [rows, cols] (sharded and gathered as its packed arrays)."""

    tag: str
    rows: int
    cols: int
    width: int
    trainable: bool = False
    gather_width: int = 0
    nf4: bool = False

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def layer_params(s: TrainingSetup, recipe: Recipe, layer: int, storage: int = 0) -> list[Param]:
    """The parameters of decoder layer `layer`, in the order of `model.parameters()`: each
    linear layer's base weight (nybble's NF4 weight, or with `storage` bitsandbytes' packed
    codes viewed as that many bytes an element), its bias, its LoRA A and B; the q/k norms;
    a mixture of experts' router and fused experts (and their adapters); the two norms."""
    a = s.arch
    un, lora, gw = recipe.unquantized, recipe.lora, recipe.lora_compute
    shapes, biases = a.linear_shapes(layer), a.linear_biases(layer)
    out: list[Param] = []
    for name in sorted(shapes, key=lambda p: p not in ATTENTION_PROJECTIONS):
        out_f, in_f = shapes[name]
        if storage:
            codes = stored_weight(out_f * in_f, s.quant, s.blocksize).codes
            out.append(Param(QUANTIZED_WEIGHTS, -(-codes // storage), 1, storage))
        else:
            out.append(Param(QUANTIZED_WEIGHTS, out_f, in_f, 1, nf4=True))
        if name in biases:
            out.append(Param(UNQUANTIZED_WEIGHTS, biases[name], 1, un))
        if name in s.targets:
            out.append(Param(LORA_PARAMS, s.lora_r, in_f, lora, True, gw))
            out.append(Param(LORA_PARAMS, out_f, s.lora_r, lora, True, gw))
    norms = a.norm_sizes()
    out += [Param(UNQUANTIZED_WEIGHTS, n, 1, un) for n in norms[2:]]  # q_norm, k_norm
    if a.is_sparse(layer):
        for name, (e, o, i) in a.expert_shapes().items():
            rows, cols = (o, i) if name == "router" else (e, o * i)
            out.append(Param(UNQUANTIZED_WEIGHTS, rows, cols, un))
        for name in s.expert_order() if s.expert_targets else ():
            experts, o, i = a.expert_shapes()[name]
            rank = s.expert_rank(name) * experts
            out.append(Param(LORA_PARAMS, rank, i, lora, True, gw))
            out.append(Param(LORA_PARAMS, o, rank, lora, True, gw))
    out += [Param(UNQUANTIZED_WEIGHTS, n, 1, un) for n in norms[:2]]
    return out


def root_params(s: TrainingSetup, recipe: Recipe) -> list[Param]:
    """The root unit's parameters: the embeddings, the final norm, an untied head."""
    a, un = s.arch, recipe.unquantized
    out = [Param(UNQUANTIZED_WEIGHTS, a.vocab_size, a.hidden_size, un)]
    out.append(Param(UNQUANTIZED_WEIGHTS, a.hidden_size, 1, un))
    if a.lm_head_params:
        out.append(Param(UNQUANTIZED_WEIGHTS, a.vocab_size, a.hidden_size, un))
    return out


def fsdp2_rows(rows: int, gpus: int) -> int:
    """Rows of FSDP2's padded shard of a parameter: `ceil(rows / gpus)` on every GPU."""
    return -(-rows // gpus)


@dataclass(frozen=True)
class Nf4Shard:
    """nybble's 4-bit weight under FSDP2, per array (codes, scales, nested scales), in
    elements of `widths` bytes: `held`, the longest rank's piece, which is what each rank keeps
    at most and puts into the all-gather (the shorter ones padded to it); `whole`, the whole
    weight's array; `in_place`, whether the ranks' pieces laid end to end are the whole array
    (then it is used where it lands, else copied into a new one at each gather). With one GPU
    only the codes are gathered."""

    held: tuple[int, ...]
    whole: tuple[int, ...]
    in_place: tuple[bool, ...]
    widths: tuple[int, ...]


@functools.lru_cache(maxsize=256)
def nf4_shard(rows: int, cols: int, blocksize: int, double_quant: bool, gpus: int) -> Nf4Shard:
    """`Nf4Shard` of W [rows, cols] on `gpus` GPUs, from nybble/torch/_packed.py's spans: rows
    [a, b) keep the codes, scales and nested scales of the blocks (and 256-block groups) their
    elements touch. `rows` must divide by `gpus` (FSDP would pad it, which a packed weight
    cannot be: `shard_model` refuses it)."""
    if rows % gpus:
        raise ValueError(f"{rows} rows do not split evenly over {gpus} GPUs")
    n = rows * cols
    nblocks = -(-n // blocksize)
    whole = [-(-n // 2), nblocks]
    widths = [1, 1 if double_quant else 4]
    if double_quant:
        whole.append(-(-nblocks // NESTED_BLOCKSIZE))
        widths.append(4)
    per = rows // gpus
    spans: list[list[tuple[int, int]]] = [[] for _ in whole]
    for r in range(gpus):
        e0, e1 = r * per * cols, (r + 1) * per * cols
        k0, k1 = e0 // blocksize, -(-e1 // blocksize)
        spans[0].append((k0 * blocksize // 2, -(-min(k1 * blocksize, n) // 2)))
        spans[1].append((k0, k1))
        if double_quant:
            spans[2].append((k0 // NESTED_BLOCKSIZE, -(-k1 // NESTED_BLOCKSIZE)))
    held, in_place = [], []
    for kind, length in enumerate(whole):
        longest = max(e - s for s, e in spans[kind])
        held.append(longest)
        pos, ok = 0, True
        for s, e in spans[kind]:
            ok = ok and s == pos and e - s == longest
            pos = e
        in_place.append(ok and pos == length)
    return Nf4Shard(tuple(held), tuple(whole), tuple(in_place), tuple(widths))


@dataclass
class Unit:
    """What one FSDP unit (a decoder layer, or the root) allocates on a GPU.

    held: (bytes, part) the GPU keeps between uses (on the host with offload: `host`)
    sent: bytes of the rank's all-gather input (its shards, as gathered)
    copy: bytes of the shards copied before the all-gather (FSDP2's foreach copy into the
          compute dtype; with offload every shard, from the host)
    cast: FSDP2 on one GPU, the shards whose dtype the copy-out changes (the LoRA's)
    flat: bytes of FSDP2's flat all-gather output (0 for FSDP1, which gathers in place)
    gathered: bytes of each unsharded tensor the gather leaves until the reshard
    grad_full: FSDP1's unsharded flat gradient (0: FSDP2, whose gradients the step makes)
    reduce_in: the reduce-scatter's input (FSDP2), reduce_out: the sharded gradient's
    optimizer: element counts of the trainable tensors' local shards (the optimizer's)
    """

    held: list[tuple[int, str]] = field(default_factory=list)
    sent: int = 0
    copy: int = 0
    cast: int = 0
    flat: int = 0
    gathered: list[int] = field(default_factory=list)
    grad_full: int = 0
    reduce_in: int = 0
    reduce_out: int = 0
    optimizer: list[int] = field(default_factory=list)
    whole_lora: list[int] = field(default_factory=list)

    @property
    def trainable(self) -> bool:
        return bool(self.optimizer)


def fsdp2_unit(s: TrainingSetup, params: Sequence[Param], what: str) -> Unit:
    """FSDP2's view of a unit of nybble-torch: per-parameter dim-0 shards padded to the GPUs,
    4-bit weights as `nf4_shard`s."""
    n = s.gpus
    u = Unit()
    for p in params:
        if p.nf4:
            try:
                w = nf4_shard(p.rows, p.cols, s.blocksize, s.double_quant, n)
            except ValueError:
                raise ValueError(
                    f"{what}: a {p.rows} x {p.cols} 4-bit weight's {p.rows} output rows do not "
                    f"split evenly over {n} GPUs; nybble.torch.distributed.shard_model refuses "
                    "it (FSDP pads uneven shards, which a packed weight cannot be)"
                ) from None
            tags = (QUANTIZED_WEIGHTS, QUANT_CONSTANTS, QUANT_CONSTANTS)[: len(w.held)]
            u.held += [(h * wd, tag) for h, wd, tag in zip(w.held, w.widths, tags, strict=True)]
            kinds = range(len(w.held)) if n > 1 else range(1)  # one GPU: the codes only
            for k in kinds:
                u.sent += w.held[k] * w.widths[k]
                u.gathered.append(n * w.held[k] * w.widths[k])
                if not w.in_place[k]:
                    u.gathered.append(w.whole[k] * w.widths[k])
            continue
        rows = fsdp2_rows(p.rows, n)
        u.held.append((rows * p.cols * p.width, p.tag))
        gw = p.gather_width or p.width
        u.sent += rows * p.cols * gw
        if gw != p.width:  # MixedPrecisionPolicy(param_dtype) casts the shard to a new tensor
            u.copy += rows * p.cols * gw
            u.cast += rows * p.cols * gw
        u.gathered.append(n * rows * p.cols * gw)
        if p.trainable:
            u.reduce_in += n * rows * p.cols * REDUCE_WIDTH
            u.reduce_out += rows * p.cols * REDUCE_WIDTH
            u.optimizer.append(min(rows, p.rows) * p.cols)  # rank 0's, the largest
            u.whole_lora.append(p.numel * p.width)
    u.flat = n * u.sent
    if s.offload:  # every shard copied from the host
        u.copy = u.cast = u.sent
    return u


def fsdp1_layout(params: Sequence[Param], width: int, gpus: int) -> tuple[int, list[int]]:
    """FSDP1's flat parameter (`use_orig_params=True`): each parameter starts at a multiple
    of `FSDP1_ALIGN` bytes, the length is padded to a multiple of `gpus`. Returns the length
    (elements of `width` bytes) and each parameter's offset."""
    align = max(FSDP1_ALIGN // width, 1)
    total, offsets = 0, []
    for p in params:
        total += -total % align
        offsets.append(total)
        total += p.numel
    total += -total % gpus
    return total, offsets


def fsdp1_unit(s: TrainingSetup, params: Sequence[Param], width: int) -> Unit:
    """FSDP1's view of a unit of bitsandbytes: one flat parameter of `width` bytes an element
    (the storage dtype), a rank's shard `length / gpus` of it; the LoRA parameters' share of
    each rank's shard differs, and the rank with the most is counted."""
    n = s.gpus
    total, offsets = fsdp1_layout(params, width, n)
    shard = total // n
    u = Unit()
    lora = [(o, p.numel) for o, p in zip(offsets, params, strict=True) if p.trainable]
    worst: list[int] = []
    for r in range(n) if lora else ():
        a, b = r * shard, (r + 1) * shard
        mine = [min(b, o + k) - max(a, o) for o, k in lora if min(b, o + k) > max(a, o)]
        if sum(mine) > sum(worst):
            worst = mine
    # the rest of the rank's shard: its share of the unquantized weights, the codes (and the
    # padding) in what is left; a unit without codes (the root) is all unquantized
    lora_held = sum(worst)
    rest = shard - lora_held
    unquantized = min(rest, -(-sum(p.numel for p in params if p.tag == UNQUANTIZED_WEIGHTS) // n))
    if any(p.tag == QUANTIZED_WEIGHTS for p in params):
        quantized = rest - unquantized
    else:
        quantized, unquantized = 0, rest
    u.held = [(quantized * width, QUANTIZED_WEIGHTS), (unquantized * width, UNQUANTIZED_WEIGHTS)]
    u.held.append((lora_held * width, LORA_PARAMS))
    u.held = [(b, tag) for b, tag in u.held if b]
    u.sent = shard * width
    u.copy = u.sent if s.offload else 0  # the shard copied from the host
    u.gathered = [total * width] if n > 1 else []  # one GPU: NO_SHARD, nothing to gather
    if lora:
        u.grad_full = total * width
        u.reduce_out = shard * width
        u.optimizer = worst
        u.whole_lora = [p.numel * p.width for p in params if p.trainable]
    return u


def replicated_constants(s: TrainingSetup, layer: int) -> list[int]:
    """bitsandbytes' quantization constants of a layer (its weights' quant state: not
    parameters, so never flattened or sharded): the bytes of each tensor, whole."""
    out = []
    for out_f, in_f in s.arch.linear_shapes(layer).values():
        w = stored_weight(out_f * in_f, s.quant, s.blocksize, s.double_quant)
        out += [w.nblocks, 4 * w.nested_blocks] if s.double_quant else [4 * w.nblocks]
    return out


# --- DDP ------------------------------------------------------------------------------------


def ddp_buckets(sizes: Sequence[int], reverse: bool = False) -> list[int]:
    """Bytes of DDP's gradient buckets for gradients of `sizes` bytes (one dtype), in the
    order of `model.parameters()` (`reverse`: the order they become ready in backward, as DDP
    rebuilds them after the first step): a bucket closes once it holds at least its cap, the
    first's `DDP_FIRST_BUCKET`, the others' `DDP_BUCKET_CAP` (c10d's
    compute_bucket_assignment_by_size)."""
    order = list(reversed(sizes)) if reverse else list(sizes)
    out, size, cap = [], 0, DDP_FIRST_BUCKET
    for n in order:
        size += n
        if size >= cap:
            out.append(size)
            size, cap = 0, DDP_BUCKET_CAP
    if size:
        out.append(size)
    return out


# --- the timelines --------------------------------------------------------------------------


class DdpTimeline(PeftBnbTimeline):
    """The single-GPU run (loaded whole on every GPU) with DDP's gradient buckets."""

    def __init__(self, s: TrainingSetup, recipe: Recipe) -> None:
        super().__init__(s, s.loop, recipe)
        self.grad_sizes = [n * self.lp for n in s.lora_tensors()]
        self.buckets: list[int] = []

    def setup(self) -> None:
        super().setup()
        self.buckets = [self.tape.new(b, COMM_BUFFERS) for b in ddp_buckets(self.grad_sizes)]

    def _forward_begins(self) -> None:
        if self.steps_done == 2:  # rebuilt in the order the first backward made the gradients
            self.tape.free(*self.buckets)
            sizes = ddp_buckets(self.grad_sizes, reverse=True)
            self.buckets = [self.tape.new(b, COMM_BUFFERS) for b in sizes]


class FsdpTimeline(PeftBnbTimeline):
    """One rank of an FSDP run (FSDP2 for nybble-torch, FSDP1 for peft-bnb; module docstring):
    the shards held, the units gathered and resharded around each layer's forward and
    backward, the gradients reduce-scattered, the optimizer on the shards."""

    def __init__(self, s: TrainingSetup, recipe: Recipe, fsdp2: bool) -> None:
        super().__init__(s, s.loop, recipe)
        self.fsdp2 = fsdp2
        self.n = s.gpus
        #: FSDP1 with one GPU does not shard (NO_SHARD): no gathers (with offload, the flat
        #: parameter copied to the GPU for each use), the whole flat gradient kept
        self.no_shard = not fsdp2 and s.gpus == 1
        self._units: dict[tuple[Param, ...], Unit] = {}
        self.units = [self._unit(layer) for layer in range(s.arch.num_layers)]
        #: with `embedding_units` (FSDP2), the embeddings and the head are units of their own
        #: and the root keeps the final norm
        self.ends: dict[int, Unit] = {}
        if s.embedding_units:
            embeddings, norm, head = root_params(s, recipe)
            self.root = fsdp2_unit(s, [norm], "the root")
            self.ends = {
                EMBEDDINGS: fsdp2_unit(s, [embeddings], "the input embeddings"),
                HEAD: fsdp2_unit(s, [head], "the output embeddings"),
            }
        else:
            self.root = self._unit(None)
        self.unsharded: dict[int, list[int]] = {}  # unit (ROOT, ...) -> its gathered tensors
        self.unsharded_next: list[int] = []  # FSDP1: what the last all-gather made
        self.deferred: int | None = None  # FSDP2: a forward all-gather's output, kept a while
        self.prefetched: tuple[int, int | None] | None = None  # FSDP2: (unit, its output)
        self.reduce_in: int | None = None  # FSDP2: the last reduce-scatter's input
        self.sharded_grads: list[int] = []
        self.grad_mark = 0

    def _unit(self, layer: int | None) -> Unit:
        s, recipe = self.s, self.recipe
        if layer is None:
            params = root_params(s, recipe)
        elif self.fsdp2:
            params = layer_params(s, recipe, layer)
        else:
            params = layer_params(s, recipe, layer, storage=recipe.lora)
        key = tuple(params)  # layers of one kind are one unit's layout: made once
        if key not in self._units:
            if self.fsdp2:
                what = "the root" if layer is None else f"decoder layer {layer}"
                self._units[key] = fsdp2_unit(s, params, what)
            else:
                self._units[key] = fsdp1_unit(s, params, recipe.lora)
        return self._units[key]

    def _unit_of(self, key: int) -> Unit:
        if key >= 0:
            return self.units[key]
        return self.root if key == ROOT else self.ends[key]

    def _all(self) -> list[Unit]:
        return [*self.units, self.root, *self.ends.values()]

    # --- at rest ----------------------------------------------------------------------

    def setup(self) -> None:
        """Each rank's shards, from a low-memory load: the 4-bit weights (and bitsandbytes'
        replicated constants) layer by layer; the root's weights whole, then sharded; PEFT's
        LoRA parameters whole on every rank, then sharded by FSDP. With offload the shards go
        to the host: only the whole tensors pass through the GPU."""
        s, tp, off = self.s, self.tape, self.s.offload
        for i, u in enumerate(self.units):
            for nbytes, tag in u.held:
                if tag in (QUANTIZED_WEIGHTS, QUANT_CONSTANTS) and not off:
                    tp.new(nbytes, tag)
            if not self.fsdp2:
                for nbytes in replicated_constants(s, i):
                    tp.new(nbytes, QUANT_CONSTANTS)
        root = root_params(s, self.recipe)
        whole = [tp.new(p.numel * p.width, UNQUANTIZED_WEIGHTS) for p in root]
        lora = [[tp.new(b, LORA_PARAMS) for b in u.whole_lora] for u in self.units]
        for u, keys in zip(self.units, lora, strict=True):
            if not off:
                for nbytes, tag in u.held:
                    if tag not in (QUANTIZED_WEIGHTS, QUANT_CONSTANTS):
                        tp.new(nbytes, tag)
            tp.free(*keys)
        if not off:
            for u in (self.root, *self.ends.values()):
                for nbytes, tag in u.held:
                    tp.new(nbytes, tag)
        tp.free(*whole)
        if self.loop == "benchmark":
            for _ in range(3):  # input_ids, attention_mask, labels: made once, kept
                tp.new(8 * self.t)

    # --- gathers ----------------------------------------------------------------------

    def _all_gather(self, u: Unit) -> int | None:
        """The rank's shards into an all-gather (on FSDP's all-gather streams): FSDP2 copies
        them (cast to the compute dtype; from the host with offload) into its flat output,
        the GPUs' shards laid end to end; FSDP1 gathers into the unit's unsharded flat
        parameter, which `_copy_out` makes (None returned). FSDP2 on one GPU gathers
        nothing (the copy-out copies the shards)."""
        tp = self.tape
        if self.fsdp2 and self.n == 1:
            return None
        self._stream(GATHER_STREAM)
        copy = tp.new(u.copy, GATHERED_PARAMS) if u.copy else None
        if self.fsdp2:
            out = tp.new(u.flat, GATHERED_PARAMS)
            tp.free(copy)
            self._stream(DEFAULT_STREAM)
            return out
        # FSDP1: the shard on the GPU (offload) stays there until the reshard
        self.unsharded_next = [tp.new(b, GATHERED_PARAMS) for b in u.gathered]
        if copy is not None:
            self.unsharded_next.append(copy)
        self._stream(DEFAULT_STREAM)
        return None

    def _copy_out(self, key: int, out: int | None, forward: bool) -> None:
        """FSDP2's wait for an all-gather: in forward it frees the previous one's output (kept
        to overlap with this one), then copies this one out into each parameter's unsharded
        tensors and keeps its output (freed at once in backward)."""
        u, tp = self._unit_of(key), self.tape
        if not self.fsdp2:
            self.unsharded[key] = self.unsharded_next
            return
        if forward:
            tp.free(self.deferred)
            self.deferred = None
        copy = tp.new(u.cast, GATHERED_PARAMS) if self.n == 1 and u.cast else None
        self.unsharded[key] = [tp.new(b, GATHERED_PARAMS) for b in u.gathered]
        tp.free(copy)
        if forward:
            self.deferred = out
        else:
            tp.free(out)

    def _gather(self, key: int, forward: bool) -> None:
        """Unit `key` (a layer, ROOT, EMBEDDINGS or HEAD) unsharded, unless it is already (or
        prefetched: then only copied out)."""
        if key in self.unsharded or (self.no_shard and not self.s.offload):
            return
        if self.prefetched is not None and self.prefetched[0] == key:
            out = self.prefetched[1]
            self.prefetched = None
        else:
            out = self._all_gather(self._unit_of(key))
        self._copy_out(key, out, forward)

    def _prefetch(self, key: int) -> None:
        """Unit `key`'s all-gather issued ahead, in backward (FSDP2 copies it out at the
        unit's own pre-backward; FSDP1's lands in the unit's flat parameter at once)."""
        if key == ROOT or key in self.unsharded or self.prefetched:
            return
        if self.no_shard and not self.s.offload:
            return
        out = self._all_gather(self._unit_of(key))
        if self.fsdp2:
            self.prefetched = (key, out)
        else:
            self.unsharded[key] = self.unsharded_next

    def _reshard(self, key: int) -> None:
        self.tape.free(*self.unsharded.pop(key, []))

    def _stream(self, n: int) -> None:
        self.tape.stream(n)

    # --- the hooks of the step -----------------------------------------------------------

    def _forward_begins(self) -> None:
        self._gather(ROOT, forward=True)

    def _embedding_begins(self) -> None:
        if EMBEDDINGS in self.ends:
            self._gather(EMBEDDINGS, forward=True)

    def _embedding_ends(self) -> None:
        self._reshard(EMBEDDINGS)

    def _head_begins(self, forward: bool) -> None:
        """The head's pre-forward, or its pre-backward (which prefetches the last layer)."""
        if HEAD in self.ends:
            self._gather(HEAD, forward=forward)
            if not forward:
                self._prefetch(len(self.units) - 1)

    def _head_ends(self) -> None:
        self._reshard(HEAD)  # frozen: no gradient to reduce

    def _layer_forward_begins(self, layer: int) -> None:
        self._gather(layer, forward=True)

    def _layer_forward_ends(self, layer: int) -> None:
        self._reshard(layer)

    def _forward_ends(self) -> None:
        """The root's post-forward: FSDP2 (whose root `shard_model` reshards after the
        forward) frees the root's unsharded tensors and the last all-gather's output; FSDP1
        keeps its root gathered for the backward."""
        if self.fsdp2:
            self._reshard(ROOT)
            self.tape.free(self.deferred)
            self.deferred = None

    def _backward_begins(self) -> None:
        """The root's pre-backward: it is gathered again (FSDP2) and prefetches the unit
        whose backward comes first: the head with `embedding_units`, else the last layer."""
        self._gather(ROOT, forward=False)
        self._prefetch(HEAD if HEAD in self.ends else len(self.units) - 1)

    def _layer_backward_begins(self, layer: int) -> None:
        self._gather(layer, forward=False)
        self._prefetch(layer - 1)
        self.grad_mark = len(self.lora_grads)

    def _layer_backward_ends(self, layer: int) -> None:
        """The unit's post-backward: resharded, then its gradients reduce-scattered."""
        u, tp = self.units[layer], self.tape
        grads = self.lora_grads[self.grad_mark :]
        del self.lora_grads[self.grad_mark :]
        if not u.trainable:
            tp.free(*grads)
            self._reshard(layer)
            return
        full = None
        if not self.fsdp2:  # autograd sums the views' gradients into the flat parameter's
            full = tp.new(u.grad_full, GRADIENTS)
            tp.free(*grads)
        self._reshard(layer)
        if self.fsdp2:
            tp.free(self.reduce_in)  # the previous reduce-scatter's input, held until now
            self.reduce_in = tp.new(u.reduce_in, COMM_BUFFERS)
            tp.free(*grads)
            self._stream(REDUCE_STREAM)
            out = tp.new(u.reduce_out, GRADIENTS)
            if self.lp != REDUCE_WIDTH:  # cast to the parameters' dtype
                cast = tp.new(u.reduce_out // REDUCE_WIDTH * self.lp, GRADIENTS)
                tp.free(out)
                out = cast
        elif self.no_shard:
            assert full is not None
            out = full
        else:
            self._stream(REDUCE_STREAM)
            out = tp.new(u.reduce_out, GRADIENTS)
            tp.free(full)
        self._stream(DEFAULT_STREAM)
        if self.s.offload:  # copied to the host's sharded gradient
            tp.free(out)
        else:
            self.sharded_grads.append(out)

    def _backward_ends(self) -> None:
        self._reshard(ROOT)
        tp = self.tape
        tp.free(self.deferred, self.reduce_in)
        self.deferred = self.reduce_in = None
        if self.prefetched is not None:
            tp.free(self.prefetched[1])
            self.prefetched = None

    def _optimizer_tensors(self) -> list[int]:
        if self.s.offload:  # the optimizer steps on the host
            return []
        return [n for u in self._all() for n in u.optimizer]

    def _optimizer(self, first: bool) -> None:
        super()._optimizer(first)
        self.tape.free(*self.sharded_grads)  # zero_grad(set_to_none=True)
        self.sharded_grads = []


def host_parts(s: TrainingSetup, timeline: FsdpTimeline) -> dict[str, int]:
    """With offload, what each process keeps in host memory: its shards, its sharded
    gradients and the optimizer's states (and its step's temporaries), by breakdown part."""
    if not s.offload:
        return {}
    out: dict[str, int] = {}
    lp = timeline.lp
    for u in timeline._all():
        for nbytes, tag in u.held:
            out[tag] = out.get(tag, 0) + nbytes
        if u.trainable:
            grad = u.reduce_out if not timeline.fsdp2 else u.reduce_out // REDUCE_WIDTH * lp
            out[GRADIENTS] = out.get(GRADIENTS, 0) + grad
        for n in u.optimizer:
            states = optimizer_states(s.optimizer, n, lp)
            states += optimizer_temporaries(s.optimizer, n, lp)
            out[OPTIMIZER_STATES] = out.get(OPTIMIZER_STATES, 0) + sum(states)
    return out


def timeline_for(s: TrainingSetup, framework: str) -> PeftBnbTimeline:
    """The timeline of one rank of `s` run by `framework` ("peft-bnb" or "nybble-torch")."""
    nybble = framework == "nybble-torch"
    recipe = nybble_torch_recipe(s) if nybble else peft_bnb_recipe(s)
    if s.strategy == "fsdp":
        return FsdpTimeline(s, recipe, fsdp2=nybble)
    if s.strategy == "ddp":
        return DdpTimeline(s, recipe)
    return PeftBnbTimeline(s, s.loop, recipe)


def check_supported(s: TrainingSetup, framework: str) -> None:
    """What the per-GPU model does not cover, refused by name."""
    if framework == "nybble-torch" and s.quant != "nf4":
        raise ValueError(
            f"framework 'nybble-torch' (nybble's torch layer) quantizes to nf4 only, got "
            f"quant={s.quant!r}"
        )
    if s.embedding_units and framework != "nybble-torch":
        raise ValueError(
            "embedding_units is shard_model's (framework 'nybble-torch'); the FSDP1 recipe of "
            f"framework {framework!r} wraps the decoder layers only"
        )
    if s.strategy == "fsdp" and s.quant not in ("nf4", "fp4"):
        raise ValueError(
            f"strategy 'fsdp' is modelled for 4-bit bases (nf4, fp4), not quant={s.quant!r}: "
            "use strategy='ddp', or one GPU"
        )


def distributed_notes(s: TrainingSetup, framework: str) -> list[str]:
    """What a per-GPU estimate rests on (docs/estimator.md, "Several GPUs")."""
    if not s.distributed:
        return []
    engine = ENGINES[(framework, s.strategy or "")]
    notes = [
        f"{engine} over {s.gpus} GPU{'s' if s.gpus > 1 else ''}"
        f"{' with CPU offload' if s.offload else ''}: the figure is per GPU, written from the "
        "engine's code and checked against 1- and 2-GPU runs (docs/multi-gpu.md); NCCL's "
        f"buffers {nccl_workspace(s.gpus) >> 20} MiB"
        f"{' (as measured)' if s.gpus in NCCL_WORKSPACE_MEASURED else ' (the 2-GPU figure)'}"
    ]
    if s.strategy == "fsdp" and framework == "peft-bnb":
        notes.append(
            f"FSDP1 flattens each unit in one dtype: the codes are stored as {s.lora_dtype} "
            "(bnb_4bit_quant_storage = lora_dtype), the other weights and the residual stream "
            "are in it too (no prepare_model_for_kbit_training cast), the quantization "
            "constants stay whole on every GPU, and each layer's gradient is its whole flat "
            "parameter's (the frozen codes' share too)"
        )
        if s.gpus == 1 and not s.offload:
            notes.append("FSDP1 does not shard on one GPU (NO_SHARD): no all-gathers")
    if s.embedding_units:
        notes.append(
            "the embeddings and the head are FSDP units of their own (shard_model(..., "
            "embedding_units=True)); on the measured runs the allocated peak was exact and the "
            "reserved peak 9-13% over (docs/estimator.md)"
        )
    if framework == "nybble-torch":
        notes.append(
            "nybble-torch is modelled as the PEFT + bitsandbytes replay with nybble's recipe "
            "(weights in the compute dtype, no up-cast; 4-bit weights sharded and gathered as "
            "packed 4-bit data under FSDP2, LoRA in mixed precision); its layer's own "
            "temporaries are bitsandbytes' (docs/estimator.md)"
        )
    if s.offload:
        notes.append(
            "CPU offload: the shards, sharded gradients and optimizer states are in host "
            "memory (host_bytes, per process; pinned), copied to the GPU for each all-gather"
        )
    return notes


__all__ = [
    "DDP_BUCKET_CAP",
    "DDP_FIRST_BUCKET",
    "ENGINES",
    "FSDP1_ALIGN",
    "NCCL_WORKSPACE",
    "NCCL_WORKSPACE_MEASURED",
    "REDUCE_WIDTH",
    "DdpTimeline",
    "FsdpTimeline",
    "Nf4Shard",
    "Param",
    "Unit",
    "check_supported",
    "ddp_buckets",
    "distributed_notes",
    "fsdp1_layout",
    "fsdp1_unit",
    "fsdp2_rows",
    "fsdp2_unit",
    "host_parts",
    "layer_params",
    "nccl_workspace",
    "nf4_shard",
    "nybble_torch_recipe",
    "peft_bnb_recipe",
    "replicated_constants",
    "root_params",
    "timeline_for",
]
