"""The `nybble` command line: one module per group of subcommands, registered here.

Exit codes: 0 success, 1 bad input (one clear line on stderr, no traceback), 2 usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import bench, demo, dequantize, estimate, generate, inspect, merge, quantize, train
from ._common import CliError

#: Each module has `register(subparsers)`, which adds its subcommands with `func` set.
COMMAND_MODULES = [demo, estimate, quantize, dequantize, merge, inspect, train, generate, bench]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="nybble",
        description="NF4 quantization, LoRA/QLoRA math and QLoRA tooling. "
        "`nybble COMMAND --help` explains each command.",
        epilog="exit codes: 0 success, 1 bad input (one line on stderr), 2 usage",
    )
    parser.add_argument("--version", action="version", version=f"nybble {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader stopped early (`| head`): not an error of ours
        _silence_stdout()
        return 0
    except (CliError, ValueError, KeyError, OSError, ImportError, MemoryError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"nybble {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"nybble {args.command}: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Python flushes stdout at exit, which to a closed pipe is one more error: point the
    descriptor at /dev/null (a new file object for sys.stdout would be one more to close)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (a test's capture): nothing is flushed to a pipe at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
