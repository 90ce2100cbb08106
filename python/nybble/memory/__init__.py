"""Memory-budget estimator: will a QLoRA fine-tune fit on my GPU? (SPEC §5)

    est = nybble.estimate_memory("qwen3-4b", batch=2, seq_len=2048)
    est.total_bytes, est.breakdown, est.fits("24GiB"), est.max_batch("rtx4090")

Pure Python (no numpy, no torch): importable anywhere, including by the GPU measurement
script in benchmarks/memory/, which checks these figures against measured peaks.
"""

from .arch import PROJECTIONS, Architecture
from .estimate import MemoryEstimate, estimate_memory
from .frameworks import (
    BREAKDOWN_KEYS,
    FRAMEWORKS,
    Footprint,
    FrameworkModel,
    PeftBnb,
    Phase,
    get_framework,
    register_framework,
)
from .presets import GPU_PRESETS, MODEL_PRESETS, parse_size
from .quant import codec_nbytes, stored_weight
from .setup import TrainingSetup, resolve_model

__all__ = [
    "BREAKDOWN_KEYS",
    "FRAMEWORKS",
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "PROJECTIONS",
    "Architecture",
    "Footprint",
    "FrameworkModel",
    "MemoryEstimate",
    "PeftBnb",
    "Phase",
    "TrainingSetup",
    "codec_nbytes",
    "estimate_memory",
    "get_framework",
    "parse_size",
    "register_framework",
    "resolve_model",
    "stored_weight",
]
