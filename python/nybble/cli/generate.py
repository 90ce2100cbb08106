"""`nybble generate`: continue a prompt with a pretrained model, optionally with a LoRA adapter
(a `nybble train` run's adapter/, or any PEFT adapter of the model), greedily or sampled,
printing the text as it is made."""

from __future__ import annotations

import argparse
import math
import sys

from .. import LoraConfig
from ..train import Trainer
from ._common import CliError, print_json

_EPILOG = """\
examples:
  nybble generate --model ./SmolLM2-135M-Instruct.Q4_1.gguf --prompt "Name three rivers."
  nybble generate --model meta-llama/Llama-3.1-8B-Instruct --adapter run1/adapter \\
      --device cuda --temperature 0.7 --top-p 0.9 --prompt "Write a haiku about rivers"

exit codes: 0 done, 1 bad input (one line on stderr), 2 usage.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "generate",
        help="continue a prompt with a pretrained model (and a LoRA adapter)",
        description=__doc__,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="HF checkpoint folder, Hub id, or .gguf file")
    p.add_argument("--adapter", help="a PEFT adapter folder of the model (e.g. run/adapter)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=256, help="at most this many (256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (0)")
    p.add_argument(
        "--chat",
        choices=["auto", "yes", "no"],
        default="auto",
        help="wrap the prompt in the chat template (auto: when the model has one)",
    )
    p.add_argument(
        "--quant",
        choices=["nf4", "none"],
        default="nf4",
        help="base weights: NF4 (as QLoRA trains them; the default) or dense",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise CliError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise CliError(f"--top-p must be in (0, 1], got {args.top_p}")
    quant = None if args.quant == "none" else "nf4"
    if args.adapter:
        lora = LoraConfig.from_peft(args.adapter)
        trainer = Trainer.from_pretrained(args.model, lora, quant=quant, device=args.device)
        trainer.load_adapter(args.adapter)
    else:
        trainer = Trainer.from_pretrained(
            args.model, None, quant=quant, device=args.device, frozen=True
        )
    if trainer.tokenizer is None:
        raise CliError(f"{args.model}: has no tokenizer to read --prompt with")
    chat = {"auto": None, "yes": True, "no": False}[args.chat]
    stream = None if args.json else _write
    result = trainer.generate(
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        chat=chat,
        on_text=stream,
    )
    if args.json:
        print_json(
            {
                "text": result.text,
                "ids": result.ids,
                "stopped": result.stopped,
                "prompt_tokens": result.prompt_tokens,
                "new_tokens": len(result.ids),
                "tokens_per_s": result.tokens_per_second,
            }
        )
    else:
        sys.stdout.write("\n")
        print(
            f"[{len(result.ids)} tokens, {result.tokens_per_second:.1f} tokens/s, "
            f"stopped at {'an end token' if result.stopped == 'stop' else 'the limit'}]",
            file=sys.stderr,
        )
    return 0


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
