"""`nybble dequantize IN OUT`: a 4-bit checkpoint back to dense safetensors
(docs/checkpoints.md)."""

from __future__ import annotations

import argparse

from ..checkpoint.dequantize import dequantize_checkpoint
from . import _checkpoint

_DESCRIPTION = """\
Dequantize a checkpoint: every quantized weight of IN (nybble's layout, or bitsandbytes'
4-bit layout as transformers saves it) is written dense to OUT, with config.json without its
quantization_config; other tensors and files are copied as they are. OUT appears complete or
not at all. IN without any quantized weight (a dense checkpoint) is an error (exit 1) and
nothing is written: there is nothing to dequantize."""

_EPILOG = f"""\
examples:
  nybble dequantize ./model-nf4 ./model-bf16 --dtype bf16
  nybble dequantize ./model-nf4 ./model-f32 --dtype float32 --max-shard-size 2GB

{_checkpoint.EXIT_CODES}
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "dequantize",
        help="dequantize a 4-bit checkpoint (nybble or bitsandbytes) to dense safetensors",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_checkpoint.Formatter,
    )
    p.add_argument("input", metavar="IN", help="quantized checkpoint directory or file")
    p.add_argument("output", metavar="OUT", help="new checkpoint directory")
    p.add_argument(
        "--dtype",
        default=None,
        help="bf16, f16 or f32 (default: the dtype each weight was quantized from)",
    )
    _checkpoint.add_output_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = _checkpoint.call(
        dequantize_checkpoint,
        args.input,
        args.output,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        device=args.device,
        overwrite=args.force,
        progress=_checkpoint.progress("dequantize"),
    )
    _checkpoint.print_report(report, args.json)
    return 0
