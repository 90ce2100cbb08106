"""The named parts of an estimate's breakdown: every allocation of the replayed run carries one.

The first eleven are tensors the run allocates (`timeline` tags each allocation with one; the
last two of them, `gathered_params` and `comm_buffers`, only a run on several GPUs: FSDP's
all-gathered layers, the reduce-scatter and DDP's gradient buckets, `distributed`); the last
three are what the GPU holds beyond them at the peak: the caching allocator's free blocks
(`reserved - allocated`), the process's memory outside the allocator (CUDA context and the
kernel modules loaded by then, `runtime.OutsideAllocator`) and, on several GPUs, NCCL's own
buffers (`distributed.nccl_workspace`, measured at one and two GPUs). They add up to `total_bytes`.
"""

from __future__ import annotations

QUANTIZED_WEIGHTS = "quantized_weights"
QUANT_CONSTANTS = "quant_constants"
UNQUANTIZED_WEIGHTS = "unquantized_weights"
LORA_PARAMS = "lora_params"
GRADIENTS = "gradients"
OPTIMIZER_STATES = "optimizer_states"
ACTIVATIONS = "activations"
LOGITS_LOSS = "logits_loss"
RUNTIME_OVERHEAD = "runtime_overhead"
GATHERED_PARAMS = "gathered_params"
COMM_BUFFERS = "comm_buffers"
ALLOCATOR_CACHE = "allocator_cache"
OUTSIDE_ALLOCATOR = "outside_allocator"
NCCL_WORKSPACE = "nccl_workspace"

#: Loading's temporaries (bf16 copies before quantization, the loader's warm-up block): all
#: freed before the first step, so never part of a step's breakdown.
LOAD = "load"

#: Parts that are tensors of the run, in display order.
TENSOR_PARTS = (
    QUANTIZED_WEIGHTS,
    QUANT_CONSTANTS,
    UNQUANTIZED_WEIGHTS,
    LORA_PARAMS,
    GRADIENTS,
    OPTIMIZER_STATES,
    ACTIVATIONS,
    LOGITS_LOSS,
    RUNTIME_OVERHEAD,
    GATHERED_PARAMS,
    COMM_BUFFERS,
)

#: The components of every breakdown, in display order; they add up to `total_bytes`.
BREAKDOWN_KEYS = (*TENSOR_PARTS, ALLOCATOR_CACHE, OUTSIDE_ALLOCATOR, NCCL_WORKSPACE)

#: The parts only a run on several GPUs has (0 in a single-GPU estimate).
DISTRIBUTED_PARTS = (GATHERED_PARAMS, COMM_BUFFERS, NCCL_WORKSPACE)

#: One line per part, for help texts and docs.
DESCRIPTIONS = {
    QUANTIZED_WEIGHTS: "4-bit (or 8-bit) codes of the base model's linear layers",
    QUANT_CONSTANTS: "their scales (absmax), nested scales under double quantization",
    UNQUANTIZED_WEIGHTS: "embeddings, lm_head, norms, dense bases, MoE experts (PEFT: float32)",
    LORA_PARAMS: "the LoRA A and B matrices",
    GRADIENTS: "gradients of the LoRA matrices",
    OPTIMIZER_STATES: "optimizer states and the optimizer step's temporaries",
    ACTIVATIONS: "saved activations, their gradients and the step's temporaries",
    LOGITS_LOSS: "logits, log-softmax and their gradients, labels",
    RUNTIME_OVERHEAD: "cuBLAS workspaces (PEFT); token ids, non-finite check slots (nybble)",
    GATHERED_PARAMS: "FSDP: the all-gathered (unsharded) parameters of the units in flight",
    COMM_BUFFERS: "FSDP's reduce-scatter buffers, DDP's gradient buckets",
    ALLOCATOR_CACHE: "free blocks the allocator (torch's, CuPy's pool) keeps at the peak",
    OUTSIDE_ALLOCATOR: "process memory outside the allocator (CUDA context, kernels)",
    NCCL_WORKSPACE: "NCCL's own buffers, outside the allocator (as measured at 1 and 2 GPUs)",
}

__all__ = [
    "ACTIVATIONS",
    "ALLOCATOR_CACHE",
    "BREAKDOWN_KEYS",
    "COMM_BUFFERS",
    "DESCRIPTIONS",
    "DISTRIBUTED_PARTS",
    "GATHERED_PARAMS",
    "GRADIENTS",
    "LOAD",
    "LOGITS_LOSS",
    "LORA_PARAMS",
    "NCCL_WORKSPACE",
    "OPTIMIZER_STATES",
    "OUTSIDE_ALLOCATOR",
    "QUANTIZED_WEIGHTS",
    "QUANT_CONSTANTS",
    "RUNTIME_OVERHEAD",
    "TENSOR_PARTS",
    "UNQUANTIZED_WEIGHTS",
]
