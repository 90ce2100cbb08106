"""`nybble quantize IN OUT`: a dense Hugging Face checkpoint to NF4 / FP4 / int8
(docs/checkpoints.md)."""

from __future__ import annotations

import argparse

from ..checkpoint.quantize import quantize_checkpoint
from . import _checkpoint

_DESCRIPTION = """\
Quantize a Hugging Face checkpoint: IN is a directory with config.json and model.safetensors
(or shards listed in model.safetensors.index.json), or one .safetensors file; OUT a new
directory. By default the linear projections of the decoder layers are quantized
(model.layers.N.*.weight, 2-D); embeddings, norms, lm_head and biases are copied as they are,
and so are the tokenizer and other small files. Weights already quantized (nybble's or
bitsandbytes' 4-bit layout) are carried over unchanged, converted losslessly to the chosen
layout.

--format bnb writes what transformers saves for a bitsandbytes 4-bit model, plus the
quantization_config in config.json: AutoModelForCausalLM.from_pretrained(OUT) loads it as a
4-bit model. The default, nybble, is nybble's own layout (docs/checkpoints.md).

The work streams one tensor at a time (memory follows the largest tensor) and OUT appears
complete or not at all."""

_EPILOG = f"""\
examples:
  nybble quantize ./Llama-3.1-8B ./Llama-3.1-8B-nf4 --format bnb --double-quant
  nybble quantize ./model ./model-q --targets q_proj v_proj "model.layers.*.mlp.*"
  nybble quantize ./model ./model-int8 --codebook int8 --blocksize 128

{_checkpoint.EXIT_CODES}
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "quantize",
        help="quantize a safetensors checkpoint (nybble's or bitsandbytes' 4-bit layout)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_checkpoint.Formatter,
    )
    p.add_argument("input", metavar="IN", help="checkpoint directory or .safetensors file")
    p.add_argument("output", metavar="OUT", help="new checkpoint directory")
    p.add_argument(
        "--format",
        default="nybble",
        choices=["nybble", "bnb"],
        help="output layout: nybble's, or bitsandbytes/transformers 4-bit (nf4, fp4)",
    )
    p.add_argument(
        "--codebook",
        default="nf4",
        choices=["nf4", "fp4", "int8"],
        help="the code table (docs/formats.md); int8 only in nybble's layout",
    )
    p.add_argument(
        "--blocksize", type=int, default=64, help="elements per scale (power of two, 32..4096)"
    )
    p.add_argument(
        "--double-quant", action="store_true", help="quantize the scales too (~0.37 bit less)"
    )
    p.add_argument(
        "--targets",
        nargs="+",
        metavar="PATTERN",
        default=None,
        help="weights to quantize instead of the decoder layers' projections: module names "
        "(q_proj, mlp.down_proj) or globs over module paths (model.layers.*.mlp.*)",
    )
    p.add_argument(
        "--compute-dtype",
        default=None,
        help="--format bnb: bnb_4bit_compute_dtype (by default the checkpoint's dtype)",
    )
    _checkpoint.add_output_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = _checkpoint.call(
        quantize_checkpoint,
        args.input,
        args.output,
        layout=args.format,
        codebook=args.codebook,
        blocksize=args.blocksize,
        double_quant=args.double_quant,
        targets=args.targets,
        compute_dtype=args.compute_dtype,
        max_shard_size=args.max_shard_size,
        device=args.device,
        overwrite=args.force,
        progress=_checkpoint.progress("quantize"),
    )
    _checkpoint.print_report(report, args.json)
    return 0
