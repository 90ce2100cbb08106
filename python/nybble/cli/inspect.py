"""`nybble inspect PATH`: what a checkpoint or safetensors file holds, and with --reference
the quantization error of each weight (docs/checkpoints.md)."""

from __future__ import annotations

import argparse
from typing import Any

from ..checkpoint.inspect import ErrorTotals, Inspection, Totals, inspect_checkpoint
from . import _checkpoint
from ._common import format_table, print_json

_DESCRIPTION = """\
Inspect a checkpoint directory (config.json with model.safetensors or shards and their
index) or one .safetensors file: every tensor (a quantized weight as one row, with all its
tensors) with its kind, format, dtype, shape, parameters and bytes, then totals per module
kind and per format. Only the headers are read, unless --reference names a dense checkpoint:
then each weight present in both is compared with it (dequantized a block run at a time):
largest and mean absolute error, RMSE relative to the reference's RMS, SNR, and the largest
error relative to its block's absmax (NF4 keeps it below 0.16), and the same figures per
format and over all weights (the only error figures --summary shows)."""

_EPILOG = f"""\
examples:
  nybble inspect ./model-nf4
  nybble inspect ./model-nf4 --reference ./model --summary
  nybble inspect ./model/model-00001-of-00004.safetensors --json

{_checkpoint.EXIT_CODES}
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "inspect",
        help="list a checkpoint's tensors, formats and sizes; quantization error vs a reference",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_checkpoint.Formatter,
    )
    p.add_argument("path", metavar="PATH", help="checkpoint directory or .safetensors file")
    p.add_argument(
        "--reference", metavar="DIR", default=None, help="dense checkpoint to compare with"
    )
    p.add_argument(
        "--summary",
        action="store_true",
        help="totals only (and with --reference the errors per format), no row per tensor",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result: Inspection = _checkpoint.call(inspect_checkpoint, args.path, args.reference)
    if args.json:
        out = result.to_json()
        if args.summary:
            out.pop("entries")
        print_json(out)
        return 0
    if not args.summary:
        print(_tensor_table(result))
        print()
    print(_totals_table("kind", result.kinds, result.total))
    print()
    print(_totals_table("format", result.formats, result.total))
    if result.error_total is not None:
        print()
        print(_errors_table(result.errors, result.error_total))
    return 0


def _tensor_table(result: Inspection) -> str:
    headers = ["tensor", "kind", "format", "dtype", "shape", "params", "bytes"]
    compare = result.reference is not None
    if compare:
        headers += ["max abs err", "mean abs err", "rel rmse", "snr dB", "max err/absmax"]
    rows: list[list[Any]] = []
    for e in result.entries:
        row: list[Any] = [
            e.name,
            e.kind,
            e.format,
            e.dtype,
            "x".join(map(str, e.shape)) or "scalar",
            e.parameters,
            e.nbytes,
        ]
        if compare:
            s = e.error
            if s is None:
                row += [e.note or "", "", "", "", ""]
            else:
                block = "" if s.max_block_relative is None else f"{s.max_block_relative:.4f}"
                row += [
                    f"{s.max_abs:.4g}",
                    f"{s.mean_abs:.4g}",
                    "" if s.relative_rmse is None else f"{s.relative_rmse:.4g}",
                    "exact" if s.snr_db is None else f"{s.snr_db:.1f}",
                    block,
                ]
        rows.append(row)
    return format_table(headers, rows)


def _errors_table(errors: dict[str, ErrorTotals], total: ErrorTotals) -> str:
    """The errors against the reference per format and over all weights compared."""
    rows: list[list[Any]] = []
    for name, t in [*sorted(errors.items()), ("total", total)]:
        rows.append(
            [
                name,
                t.weights,
                t.parameters,
                f"{t.max_abs:.4g}",
                f"{t.mean_abs:.4g}",
                "" if t.relative_rmse is None else f"{t.relative_rmse:.4g}",
                ("exact" if t.weights else "") if t.snr_db is None else f"{t.snr_db:.1f}",
                "" if t.max_block_relative is None else f"{t.max_block_relative:.4f}",
                t.not_compared,
            ]
        )
    headers = ["vs reference", "compared", "params", "max abs err", "mean abs err", "rel rmse"]
    return format_table([*headers, "snr dB", "max err/absmax", "not compared"], rows)


def _totals_table(what: str, totals: dict[str, Totals], total: Totals) -> str:
    rows: list[list[Any]] = [
        [name, t.tensors, t.parameters, t.nbytes, f"{t.bits_per_parameter:.3f}"]
        for name, t in sorted(totals.items())
    ]
    rows.append(
        ["total", total.tensors, total.parameters, total.nbytes, f"{total.bits_per_parameter:.3f}"]
    )
    return format_table([what, "tensors", "params", "bytes", "bits/param"], rows)
