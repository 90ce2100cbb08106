"""A PNG of estimated peak memory against sequence length (matplotlib, imported lazily)."""

from __future__ import annotations

from typing import IO, Any

from .estimate import MemoryEstimate
from .frameworks import BREAKDOWN_KEYS
from .presets import GiB


def seq_len_grid(estimate: MemoryEstimate, points: int = 24) -> list[int]:
    """Sequence lengths from 128 to a bit past the estimate's own (powers of two and halves)."""
    top = max(4096, 2 * estimate.setup.seq_len)
    grid: list[int] = []
    n = 128
    while n <= top and len(grid) < points:
        grid.append(n)
        if n * 3 // 2 <= top:
            grid.append(n * 3 // 2)
        n *= 2
    if estimate.setup.seq_len not in grid:
        grid.append(estimate.setup.seq_len)
    return sorted(set(grid))


def plot_seq_len(
    estimate: MemoryEstimate,
    out: IO[bytes],
    gpu_bytes: int | None = None,
    gpu_label: str | None = None,
) -> None:
    """Stacked breakdown of `total_bytes` against seq_len, with the GPU's size as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    grid = seq_len_grid(estimate)
    sweep = estimate.sweep_seq_len(grid)
    fig: Any
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    layers = [[e.breakdown[k] / GiB for e in sweep] for k in BREAKDOWN_KEYS]
    labels = [k.replace("_", " ") for k in BREAKDOWN_KEYS]
    ax.stackplot(grid, layers, labels=labels, alpha=0.85)
    ax.plot(grid, [e.total_bytes / GiB for e in sweep], color="black", lw=1.5, label="total")
    if gpu_bytes:
        ax.axhline(gpu_bytes / GiB, color="red", ls="--", lw=1.2, label=gpu_label or "GPU")
    s = estimate.setup
    title = (
        f"{s.arch.name}: {s.quant} r={s.lora_r} batch={s.batch} "
        f"{'grad ckpt' if s.grad_checkpointing else 'no grad ckpt'} ({estimate.framework})"
    )
    ax.set_title(title, fontsize=10)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, format="png")
    plt.close(fig)
