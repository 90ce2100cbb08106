"""`nybble merge BASE ADAPTER OUT`: a PEFT adapter merged into its base checkpoint, written
dense (docs/checkpoints.md)."""

from __future__ import annotations

import argparse

from ..checkpoint.merge import merge_adapter
from . import _checkpoint

_DESCRIPTION = """\
Merge a PEFT LoRA adapter (LoRA, rsLoRA, DoRA; rank and alpha patterns) into its base model:
BASE is a dense or 4-bit checkpoint (nybble's or bitsandbytes' layout), ADAPTER a directory
with adapter_config.json and adapter_model.safetensors as PEFT saves them. OUT holds the
merged model, dense (a 4-bit base is dequantized), as PEFT's merge_and_unload gives it:
modules_to_save copies saved with the adapter replace the base's weights, trainable tokens'
rows replace those rows of the embedding (what cannot be merged exactly, such as a trained
lm_head of a model that ties it to the embeddings, is an error). OUT appears complete or not
at all."""

_EPILOG = f"""\
examples:
  nybble merge ./Llama-3.1-8B ./my-adapter ./Llama-3.1-8B-merged
  nybble merge ./Llama-3.1-8B-nf4 ./my-qlora-adapter ./merged --dtype bf16

{_checkpoint.EXIT_CODES}
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "merge",
        help="merge a PEFT LoRA/DoRA adapter into a dense or 4-bit checkpoint",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_checkpoint.Formatter,
    )
    p.add_argument("base", metavar="BASE", help="base checkpoint directory or file")
    p.add_argument("adapter", metavar="ADAPTER", help="PEFT adapter directory")
    p.add_argument("output", metavar="OUT", help="new checkpoint directory")
    p.add_argument(
        "--dtype",
        default=None,
        help="bf16, f16 or f32 for merged (and dequantized) weights (default: the base's)",
    )
    _checkpoint.add_output_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = _checkpoint.call(
        merge_adapter,
        args.base,
        args.adapter,
        args.output,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        device=args.device,
        overwrite=args.force,
        progress=_checkpoint.progress("merge"),
    )
    _checkpoint.print_report(report, args.json)
    return 0
