"""A PNG of the estimated memory against sequence length (matplotlib, imported lazily)."""

from __future__ import annotations

from typing import IO, Any

from .estimate import MemoryEstimate, seq_len_step
from .parts import BREAKDOWN_KEYS
from .presets import GiB

#: Points of the sweep (each one a full estimate).
POINTS = 14


def seq_len_grid(top: int, chosen: int, points: int = POINTS) -> list[int]:
    """About `points` sequence lengths from 128 to `top`, evenly spaced on a log scale and
    rounded to multiples of 64, with `chosen` among them."""
    top = max(top, 256)
    ratio = (top / 128) ** (1 / max(points - 1, 1))
    grid = {128, top, chosen}
    n = 128.0
    for _ in range(points):
        grid.add(max(64, round(n / 64) * 64))
        n *= ratio
    return sorted(x for x in grid if 1 <= x <= top)


def plot_seq_len(estimate: MemoryEstimate, out: IO[bytes]) -> None:
    """Stacked breakdown of `total_bytes` against seq_len at the estimate's batch. With a GPU
    on the estimate: its memory as a line, the x range past the longest sequence that fits,
    which is marked where the total crosses the line; the estimate's own point marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise ImportError(
            'plotting needs matplotlib: pip install "nybble[plot]" (the plot extra)'
        ) from None
    s = estimate.setup
    fitting = estimate.max_seq_len(multiple_of=seq_len_step(s.seq_len)) if estimate.gpu else 0
    top = max(4096, 2 * s.seq_len, fitting * 3 // 2)
    grid = seq_len_grid(top, s.seq_len)
    if fitting and fitting not in grid:
        grid = sorted({*grid, fitting})
    sweep = estimate.sweep_seq_len(grid)
    fig: Any
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    layers = [[e.breakdown[k] / GiB for e in sweep] for k in BREAKDOWN_KEYS]
    labels = [k.replace("_", " ") for k in BREAKDOWN_KEYS]
    palette = plt.get_cmap("tab20")
    colors = [palette(i) for i in range(len(BREAKDOWN_KEYS))]  # one colour per part
    ax.stackplot(grid, layers, labels=labels, colors=colors, alpha=0.85)
    ax.plot(grid, [e.total_bytes / GiB for e in sweep], color="black", lw=1.5, label="total")
    ax.plot(
        [s.seq_len],
        [estimate.total_bytes / GiB],
        marker="o",
        color="black",
        ms=7,
        ls="none",
        label=f"this run: {s.seq_len} tokens, {estimate.total_gib:.2f} GiB",
    )
    gpu = estimate.gpu
    if gpu is not None:
        ax.axhline(gpu.total_bytes / GiB, color="red", ls="--", lw=1.2, label=gpu.label)
        if fitting:
            ax.axvline(fitting, color="red", ls=":", lw=1.2)
            ax.annotate(
                f"fits up to {fitting} tokens",
                (fitting, gpu.total_bytes / GiB),
                textcoords="offset points",
                xytext=(-8, 8),
                ha="right",
                fontsize=8,
                color="red",
            )
    title = (
        f"{s.arch.name}: {s.quant} r={s.lora_r} batch={s.batch} "
        f"{'grad ckpt' if s.grad_checkpointing else 'no grad ckpt'} ({estimate.framework}, "
        f"{s.loop} loop)"
    )
    ax.set_title(title, fontsize=10)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{round(x):,}"))
    ax.set_xlim(grid[0], grid[-1])
    ax.set_xlabel(f"sequence length (tokens per sequence; batch {s.batch})")
    ax.set_ylabel("GPU memory of the process at the peak (GiB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, format="png")
    plt.close(fig)
