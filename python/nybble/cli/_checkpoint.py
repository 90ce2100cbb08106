"""What the checkpoint subcommands share (quantize.py, dequantize.py, merge.py, inspect.py of
this package): the common options, turning every failure into one line, and the report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ..checkpoint import DEFAULT_MAX_SHARD_SIZE, ProgressBar, Report
from ._common import CliError, print_json

EXIT_CODES = "exit codes: 0 done, 1 bad input (one line on stderr), 2 usage."


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after options' help (not for flags and options without one); description and
    epilog kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def add_output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-shard-size",
        default=f"{DEFAULT_MAX_SHARD_SIZE // 10**9}GB",
        help="largest output shard, as transformers' save_pretrained shards: a number of "
        "bytes, or with a unit: KB, MB, GB, TB are powers of 1000 (GB = 10^9 bytes, as "
        "huggingface_hub reads 5GB), KiB, MiB, GiB, TiB powers of 1024 (GiB = 2^30 bytes); "
        "a tensor larger than this gets a shard of its own",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where to compute: cuda uses the GPU kernels (needs CuPy and a GPU)",
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def call(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs a library function; what it cannot do becomes one line (CliError, exit 1)."""
    try:
        return func(*args, **kwargs)
    except ImportError as e:  # CuPy missing for --device cuda
        raise CliError(str(e)) from None
    except MemoryError:
        raise CliError("out of memory (a tensor larger than the memory available?)") from None
    except (RecursionError, OverflowError) as e:  # never expected: still one line
        raise CliError(f"cannot process the input ({type(e).__name__})") from None


def progress(label: str) -> ProgressBar:
    return ProgressBar(label, sys.stderr)


def print_report(report: Report, as_json: bool) -> None:
    for note in report.notes:  # on stderr, so that --json output stays one object
        print(f"nybble {report.action}: note: {note}", file=sys.stderr)
    if as_json:
        print_json(report.summary())
        return
    s = report.summary()
    what = ", ".join(f"{n} {k}" for k, n in s.items() if k in _COUNTS and n)
    rate = f", {s['gb_per_s']:.2f} GB/s" if s["gb_per_s"] else ""
    print(
        f"{report.target}: {what or 'nothing to do'}; read {report.bytes_read / 1e9:.3f} GB, "
        f"wrote {report.bytes_written / 1e9:.3f} GB in {len(report.files)} files "
        f"({report.seconds:.1f} s{rate})"
    )


_COUNTS = ("quantized", "converted", "dequantized", "merged", "replaced", "copied")
