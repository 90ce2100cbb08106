"""The `nybble` command line: one module per group of subcommands, registered here.

Exit codes: 0 success, 1 bad input (one clear line on stderr, no traceback), 2 usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import demo, dequantize, estimate, inspect, merge, quantize
from ._common import CliError

#: Each module has `register(subparsers)`, which adds its subcommands with `func` set.
COMMAND_MODULES = [demo, estimate, quantize, dequantize, merge, inspect]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nybble", description="NF4 quantization, LoRA/QLoRA math and QLoRA tooling."
    )
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
        sys.stdout = open(os.devnull, "w")  # nothing more reaches the closed pipe at exit
        return 0
    except (CliError, ValueError, KeyError, OSError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"nybble {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"nybble {args.command}: interrupted", file=sys.stderr)
        return 130
