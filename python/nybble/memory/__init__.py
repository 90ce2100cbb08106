"""Memory-budget estimator: will a QLoRA fine-tune fit on my GPU? (docs/estimator.md)

    est = nybble.estimate_memory("qwen3-4b", batch=2, seq_len=2048, gpu="rtx4090")
    est.total_bytes, est.breakdown, est.fits(), est.max_batch(), est.suggestions()

A run's allocations are replayed through a simulation of the GPU's allocator: for transformers +
PEFT + bitsandbytes written down from the architecture (`timeline`), for nybble's own trainer
recorded from its own code run on the recording backend (`trainer_run`). Model configs are read
through nybble's one model of a Hugging Face config (`nybble.train.config.HfConfig`). No torch:
the figures are checked against measured peaks by the scripts in benchmarks/memory/.

Several GPUs (`estimate_memory(..., gpus=4, strategy="fsdp")`): each GPU's peak under FSDP or
DDP, the timeline of one rank with what the engine shards, gathers and reduces (`distributed`;
checked against 1- and 2-GPU runs).
"""

from .arch import PROJECTIONS, Architecture
from .distributed import NCCL_WORKSPACE
from .estimate import MemoryEstimate, Suggestion, estimate_memory
from .frameworks import (
    FRAMEWORKS,
    Footprint,
    FrameworkModel,
    NybbleTorch,
    PeftBnb,
    Phase,
    get_framework,
    register_framework,
)
from .parts import BREAKDOWN_KEYS
from .presets import GPU_PRESETS, GPUS, MODEL_PRESETS, GpuSpec, parse_size, resolve_gpu
from .quant import codec_nbytes, stored_weight
from .runtime import DEFAULT_OUTSIDE_ALLOCATOR, outside_allocator
from .setup import LOOPS, STRATEGIES, TrainingSetup, resolve_model

__all__ = [
    "BREAKDOWN_KEYS",
    "DEFAULT_OUTSIDE_ALLOCATOR",
    "FRAMEWORKS",
    "GPUS",
    "GPU_PRESETS",
    "LOOPS",
    "MODEL_PRESETS",
    "NCCL_WORKSPACE",
    "PROJECTIONS",
    "STRATEGIES",
    "Architecture",
    "Footprint",
    "FrameworkModel",
    "GpuSpec",
    "MemoryEstimate",
    "NybbleTorch",
    "PeftBnb",
    "Phase",
    "Suggestion",
    "TrainingSetup",
    "codec_nbytes",
    "estimate_memory",
    "get_framework",
    "outside_allocator",
    "parse_size",
    "register_framework",
    "resolve_gpu",
    "resolve_model",
    "stored_weight",
]
