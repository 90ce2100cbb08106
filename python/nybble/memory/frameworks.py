"""Whose memory behaviour an estimate models: one `FrameworkModel` per training runtime.

A framework model turns a `TrainingSetup` into the GPU memory of the runtime's training step:
a list of *phases* (moments of the step where the allocated memory can peak, each split into
the breakdown's components), the allocator's cache on top of the highest one, and the CUDA
context. `estimate_memory` takes the highest phase. A new runtime (nybble's own GPU trainer)
is one more subclass registered with `register_framework`; nothing else changes.

`PeftBnb` models transformers + PEFT + bitsandbytes QLoRA, the standard recipe of SPEC §5.
Its breakdown comes from the tensors each op saves for backward (counted op by op, and
checked by counting the saved tensors of a real forward pass) and from the transients of the
peak moments. What the caching allocator reserves on top comes from replaying the run's
allocations in order (`timeline`) through a simulation of the allocator (`allocator`). Both
were compared with peaks and allocation traces measured on an H100 (benchmarks/memory/).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from .allocator import replay
from .presets import MiB
from .quant import FLOAT_FORMATS, stored_weight
from .setup import TrainingSetup, optimizer_states, optimizer_temporaries
from .timeline import CUBLAS_WORKSPACE, peft_bnb_events

#: The components of every breakdown, in display order.
BREAKDOWN_KEYS = (
    "quantized_weights",
    "quant_constants",
    "unquantized_weights",
    "lora_params",
    "gradients",
    "optimizer_states",
    "activations",
    "logits_loss",
    "runtime_overhead",
)

#: The CUDA caching allocator rounds every block up to this many bytes.
ALLOC_ROUND = 512


def blk(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for a tensor of `nbytes` bytes."""
    return -(-nbytes // ALLOC_ROUND) * ALLOC_ROUND


@dataclass
class Phase:
    """Allocated bytes at one moment of the training step, by breakdown component."""

    name: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class Footprint:
    """A framework model's answer for one setup."""

    phases: list[Phase]
    allocator_cache: int
    context: int
    notes: list[str] = field(default_factory=list)
    details: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)


class FrameworkModel(ABC):
    """The memory behaviour of one training runtime."""

    name: ClassVar[str]
    description: ClassVar[str]

    @abstractmethod
    def footprint(self, setup: TrainingSetup) -> Footprint:
        """Phases, allocator cache and CUDA context of one training step of `setup`."""

    def quick_footprint(self, setup: TrainingSetup) -> Footprint:
        """A footprint whose total is never above `footprint`'s, for searches to rule out
        sizes quickly; by default `footprint` itself."""
        return self.footprint(setup)


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


# --- transformers + PEFT + bitsandbytes ---------------------------------------------------


@dataclass(frozen=True)
class PeftBnbConstants:
    """Measured constants of the runtime (H100, torch 2.11, CUDA 13, bitsandbytes 0.50.2)."""

    #: Process memory NVML reports right after CUDA initialisation (SPEC §5's context).
    cuda_context: int = 518 * MiB
    #: cuBLAS workspace per (handle, stream); the forward thread and the autograd thread each
    #: get one. 32 MiB on Hopper with torch >= 2.3 (8 MiB + 128 KiB on older GPUs).
    cublas_workspace: int = CUBLAS_WORKSPACE
    cublas_handles: int = 2
    #: float32 intermediate-sized gradients alive at once in the MLP backward
    mlp_grads: int = 2


class PeftBnb(FrameworkModel):
    """transformers + PEFT + bitsandbytes, the recipe of SPEC §5.

    What decides its memory:
    - `prepare_model_for_kbit_training` casts every non-quantized parameter (embeddings,
      lm_head, norms) to float32, so the residual stream, the attention inputs and the
      logits are float32 even though bitsandbytes computes the matmuls in bf16;
    - with float32 inputs, SDPA's flash kernel is out; the memory-efficient kernel takes
      float32 but not grouped-query attention, so GQA models (Llama 3, Qwen3, Mistral) fall
      to the math backend, which stores the `batch x heads x seq x seq` softmax of every layer;
    - `loss` is float32 cross-entropy over the full vocabulary: log-softmax saved, then its
      gradient and the logits' gradient at the start of backward (3 x tokens x vocab x 4);
    - gradient checkpointing (reentrant, as PEFT enables it) saves each layer's input and
      recomputes one layer at a time in backward.
    """

    name = "peft-bnb"
    description = "transformers + PEFT + bitsandbytes (prepare_model_for_kbit_training)"

    def __init__(self, constants: PeftBnbConstants | None = None) -> None:
        self.c = constants or PeftBnbConstants()

    # --- static storage -------------------------------------------------------------

    def weights(self, s: TrainingSetup) -> dict[str, int]:
        a = s.arch
        shapes = a.linear_shapes()
        codes = consts = 0
        for out_f, in_f in shapes.values():
            n = out_f * in_f
            if s.quant in ("nf4", "fp4"):
                w = stored_weight(n, s.quant, s.blocksize, s.double_quant)
                codes += blk(w.codes)
                if s.double_quant:
                    # uint8 absmax, f32 nested absmax, f32 nested code[256], offset, code[16]
                    consts += blk(w.nblocks) + blk(4 * w.nested_blocks) + blk(1024) + 2 * blk(4)
                    consts += blk(64) - blk(4)
                else:
                    consts += blk(4 * w.nblocks) + blk(64)
            elif s.quant == "int8":
                # LLM.int8: int8 weight, one f32 scale per output row
                codes += blk(n)
                consts += blk(4 * out_f)
            else:
                codes += blk(n * FLOAT_FORMATS[s.quant])
        up = 4 if s.quantized else FLOAT_FORMATS[s.quant]
        unq = blk(a.embedding_params * up) + (blk(a.lm_head_params * up) if a.lm_head_params else 0)
        per_layer = sum(blk(n * up) for n in a.norm_sizes())
        per_layer += sum(blk(n * up) for n in a.linear_biases().values())
        unq += a.num_layers * per_layer + blk(a.hidden_size * up)
        unq += 2 * blk(a.head_dim // 2 * 4)  # rotary inv_freq buffers
        return dict(
            quantized_weights=a.num_layers * codes if s.quantized else 0,
            quant_constants=a.num_layers * consts,
            unquantized_weights=unq + (0 if s.quantized else a.num_layers * codes),
        )

    def optimizer_bytes(self, s: TrainingSetup, tensors: list[int], pbytes: int) -> int:
        return sum(blk(b) for n in tensors for b in optimizer_states(s.optimizer, n, pbytes))

    def optimizer_temporaries(self, s: TrainingSetup, tensors: list[int], pbytes: int) -> int:
        return sum(blk(b) for n in tensors for b in optimizer_temporaries(s.optimizer, n, pbytes))

    # --- activations ----------------------------------------------------------------

    def act_bytes(self, s: TrainingSetup) -> int:
        """Bytes per element of the residual stream: float32 after PEFT's up-cast."""
        return 4 if s.quantized else FLOAT_FORMATS[s.quant]

    def attention_backend(self, s: TrainingSetup) -> str:
        if self.act_bytes(s) == 4:
            return "math" if s.arch.is_gqa else "efficient"
        return "flash"

    def layer_saved(self, s: TrainingSetup) -> dict[str, int]:
        """Bytes one decoder layer saves for backward (without its input), by part."""
        a, t = s.arch, s.tokens
        e = self.act_bytes(s)
        h, i, qd, kvd = a.hidden_size, a.intermediate_size, a.q_dim, a.kv_dim
        lb = FLOAT_FORMATS[s.lora_dtype]
        tg = set(s.targets)
        lora_in_cast = lb != e  # PEFT casts the input to the adapter dtype, a copy per target
        attn = 4 * t  # rsqrt of the input norm (float32)
        if tg & {"q_proj", "k_proj", "v_proj"}:
            attn += e * t * h  # norm output, the LoRA A input
        if a.qk_norm:
            attn += 4 * t * (qd + kvd) + 4 * t * (a.num_heads + a.num_kv_heads)
        backend = self.attention_backend(s)
        if backend == "math":
            # q * scale, (k repeated to all heads)^T * scale, v repeated, softmax(scores)
            attn += 3 * 4 * t * qd + 4 * s.batch * a.num_heads * s.seq_len * s.seq_len
            if "o_proj" in tg:
                attn += 4 * t * qd  # the contiguous output, o_proj's LoRA input
        else:
            attn += e * t * (qd + 2 * kvd)  # q, k after rotary; v
            attn += e * t * qd + 4 * s.batch * a.num_heads * (-(-s.seq_len // 32) * 32)
        mlp = 4 * t + e * t * h  # rsqrt and input of the post-attention norm
        if tg & {"gate_proj", "up_proj"}:
            mlp += e * t * h
        mlp += 3 * e * t * i  # gate out (silu), silu out and up out (the product)
        if "down_proj" in tg:
            mlp += e * t * i
        lora_a = 0
        for name in s.targets:
            lora_a += blk(lb * t * s.lora_r)
            if lora_in_cast:
                lora_a += lb * t * a.linear_shapes()[name][1]
            if s.lora_dropout > 0:
                # dropout output (saved by lora_A) and its mask, one per target
                lora_a += (lb + 1) * t * a.linear_shapes()[name][1]
        return dict(attention=attn, mlp=mlp, lora=lora_a)

    def footprint(self, s: TrainingSetup) -> Footprint:
        return self._footprint(s, allocator_cache=True)

    def quick_footprint(self, s: TrainingSetup) -> Footprint:
        """Without the allocator's cache (no replay): the allocated peak and the context."""
        return self._footprint(s, allocator_cache=False)

    def _footprint(self, s: TrainingSetup, allocator_cache: bool) -> Footprint:
        a, t, c = s.arch, s.tokens, self.c
        e = self.act_bytes(s)
        h, i, qd, kvd, v = a.hidden_size, a.intermediate_size, a.q_dim, a.kv_dim, a.vocab_size
        heads, seq, b = a.num_heads, s.seq_len, s.batch
        L = a.num_layers

        w = self.weights(s)
        lora_elems = s.lora_tensors()
        pb = FLOAT_FORMATS[s.lora_dtype]
        lora_bytes = sum(blk(n * pb) for n in lora_elems)
        opt = self.optimizer_bytes(s, lora_elems, pb)
        per_layer_lora = lora_bytes // L
        workspace = c.cublas_workspace * c.cublas_handles
        inputs = 3 * blk(8 * t)  # input_ids, attention_mask, labels (int64)
        static = dict(w, lora_params=lora_bytes, optimizer_states=opt)

        saved = self.layer_saved(s)
        layer_in = e * t * h  # one layer's input (the residual stream)
        rope = 2 * blk(4 * seq * a.head_dim)  # cos, sin (batch-broadcast)
        logp = blk(4 * t * v)
        tail = 4 * t + blk(8 * t)  # the final norm's rsqrt, the shifted labels
        once = rope + inputs
        s2 = 4 * b * heads * seq * seq  # one float32 batch x heads x seq x seq tensor
        math = self.attention_backend(s) == "math"
        grad_stream = 4 * t * h  # gradient of the residual stream
        if math:
            # _safe_softmax backward: its saved output, the gradient of the probabilities,
            # the masked (where) gradient and the scores' gradient: 3 more seq^2 tensors;
            # and the gradient of the repeated v
            attn_bwd = 3 * s2 + 4 * t * qd
        else:
            attn_bwd = 4 * t * (2 * qd + 2 * kvd)
        # MLP backward: gradients of the product's two factors and of down_proj's input
        # (float32), or down_proj's bf16 weight dequantized beside two gradients
        mlp_bwd = max(c.mlp_grads * 4 * t * i, 2 * h * i + 4 * t * i + 2 * t * i)
        layer_lora_grads = per_layer_lora
        layer_saved = saved["attention"] + saved["mlp"] + saved["lora"]

        if s.grad_checkpointing:
            # every layer's input (layer 0's is the embedding output) and the last output
            stack = (L + 1) * layer_in
        else:
            # L - 1 layer inputs and the last output; layer 0's input norm saves nothing
            # (its input needs no gradient without checkpointing)
            stack = L * layer_saved + L * layer_in - 4 * t

        def phase(name: str, activations: int, logits: int, grads: int) -> Phase:
            parts = dict(static)
            parts["gradients"] = grads
            parts["activations"] = activations
            parts["logits_loss"] = logits
            parts["runtime_overhead"] = workspace
            return Phase(name, {k: parts.get(k, 0) for k in BREAKDOWN_KEYS})

        phases = [
            # end of forward: logits and log-softmax both alive
            phase("forward (loss)", stack + once + tail, blk(4 * t * v) + logp, 0),
            # start of backward: log-softmax, its gradient and the logits' gradient
            phase("backward (loss)", stack + once + tail, 3 * logp, 0),
        ]
        if s.grad_checkpointing:
            # layer L-1 recomputed: its saved tensors on top of the layers' inputs
            below = L * layer_in + once + layer_saved
        else:
            below = stack - layer_in + once  # the last layer's output is freed
        phases.append(
            phase(
                "backward (last layer, MLP)",
                below + grad_stream + mlp_bwd,
                0,
                0,
            )
        )
        phases.append(
            phase(
                "backward (last layer, attention)",
                below - saved["mlp"] + grad_stream + attn_bwd,
                0,
                layer_lora_grads,
            )
        )
        phases.append(
            phase(
                "optimizer step",
                inputs,
                0,
                lora_bytes + self.optimizer_temporaries(s, lora_elems, pb),
            )
        )
        peak = max(phases, key=lambda p: p.total)
        # What the allocator reserves on top: the run's allocations replayed through the
        # caching allocator simulation (setup and two steps; step 2's peak).
        reserved = replay(peft_bnb_events(s)).peak_reserved if allocator_cache else 0
        cache = max(reserved - peak.total, 0)
        notes = []
        if math:
            notes.append(
                "attention runs on SDPA's math backend (float32 inputs with grouped-query "
                "attention): it stores batch x heads x seq^2 floats per layer"
            )
        return Footprint(
            phases=phases,
            allocator_cache=cache,
            context=c.cuda_context,
            notes=notes,
            details=dict(
                cublas_workspace=workspace,
                attention_s2_bytes=s2 if math else 0,
                logits_bytes=logp,
                setup_allocated=sum(w.values()) + lora_bytes,
                simulated_reserved=reserved,
            ),
        )


register_framework(PeftBnb())
