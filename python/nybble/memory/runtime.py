"""The process's GPU memory outside torch's caching allocator: a named parameter of the runtime.

A training process holds more than `torch.cuda.memory_reserved()`: the CUDA context and every
kernel module loaded by then (cuBLAS, the attention kernels, bitsandbytes' library). With lazy
module loading (CUDA's default since 11.7) it grows as the first step runs: on an H100 with
driver 580 and torch 2.11+cu130, 518 MiB before any tensor, 612 MiB after the first tensor op
and 742 MiB after a QLoRA training step (an earlier probe read 619 and 751
MiB: a process that had loaded more). The figure that sits next to the reserved
peak is the last one: NVML's process memory minus `memory_reserved()` right after a steady
step. The validation run (tests/fixtures/memory/results.jsonl) measured it after each of 4
steps in 79 fresh processes: 742 MiB in all 75 dense ones from step 1 on, 744 MiB in the 4
mixtures of experts (docs/estimator.md). `total_bytes` adds it to the replayed reserved peak.

It depends on the GPU generation (kernel images per architecture), the CUDA major version and
the torch build, so it is kept per (generation, CUDA major, torch minor) where measured; other
setups get the default, which is the one measurement there is. Pass your own (`context=` in
`estimate_memory`, `--context` on the command line) after measuring it as above.
"""

from __future__ import annotations

from dataclasses import dataclass

from .presets import MiB

#: (GPU generation, CUDA major, torch "major.minor") -> bytes outside the allocator after a
#: steady QLoRA step (transformers + PEFT + bitsandbytes), measured as described above.
MEASURED_OUTSIDE_ALLOCATOR: dict[tuple[str, int, str], int] = {
    ("hopper", 13, "2.11"): 742 * MiB,
}

#: The figure used where nothing was measured: the H100 / CUDA 13 / torch 2.11 measurement.
DEFAULT_OUTSIDE_ALLOCATOR = MEASURED_OUTSIDE_ALLOCATOR[("hopper", 13, "2.11")]

#: The most a QLoRA process was measured to hold outside the allocator after a step on that
#: runtime: 751 MiB (the probe of SPEC section 5, and issue 39's run, which enabled gradient
#: checkpointing after get_peft_model); the validation run's 79 read 742 to 744 MiB. The
#: verdicts (`MemoryEstimate.required_bytes`) count this one unless a figure is given.
HIGHEST_OUTSIDE_ALLOCATOR = 751 * MiB


@dataclass(frozen=True)
class OutsideAllocator:
    """Bytes the process holds outside the caching allocator, and where the figure comes from
    (`"measured: hopper, CUDA 13, torch 2.11"`, `"default (...)"` or `"given"`)."""

    nbytes: int
    source: str


def outside_allocator(
    generation: str | None = None, cuda_major: int | None = None, torch_version: str | None = None
) -> OutsideAllocator:
    """The measured figure for this runtime if there is one, else the default."""
    if generation is not None and cuda_major is not None and torch_version is not None:
        minor = ".".join(str(torch_version).split("+")[0].split(".")[:2])
        key = (generation.lower(), int(cuda_major), minor)
        if key in MEASURED_OUTSIDE_ALLOCATOR:
            return OutsideAllocator(
                MEASURED_OUTSIDE_ALLOCATOR[key],
                f"measured: {key[0]}, CUDA {key[1]}, torch {key[2]}",
            )
    return OutsideAllocator(
        DEFAULT_OUTSIDE_ALLOCATOR, "default (measured on an H100, CUDA 13, torch 2.11)"
    )


__all__ = [
    "DEFAULT_OUTSIDE_ALLOCATOR",
    "HIGHEST_OUTSIDE_ALLOCATOR",
    "MEASURED_OUTSIDE_ALLOCATOR",
    "OutsideAllocator",
    "outside_allocator",
]
