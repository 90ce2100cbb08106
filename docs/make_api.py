"""Writes docs/api.md from the package's docstrings and the command line's --help, so the API
page says what the code says. `python docs/make_api.py` rewrites it;
tests/docs/test_docs.py fails when it is out of date.

    python docs/make_api.py [--check]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import os
import sys
from pathlib import Path
from typing import Any

PAGE = Path(__file__).with_name("api.md")

#: (module, names): the public API, in the order a reader meets it.
SECTIONS: list[tuple[str, str, list[str] | None]] = [
    ("nybble", "The codec", ["quantize", "dequantize", "NF4Tensor"]),
    ("nybble.errors", "Errors", ["NonFiniteError", "FormatError"]),
    (
        "nybble",
        "LoRA and QLoRA",
        ["LoraConfig", "LoraLinear", "QLoraLinear", "LoraAdapter", "AdamW"],
    ),
    (
        "nybble.bnb",
        "bitsandbytes interop",
        ["export_state", "import_state", "quantize_4bit", "swap_nibbles"],
    ),
    ("nybble.cuda", "The GPU", None),
    ("nybble.models", "Pretrained models", None),
    ("nybble.train", "Training", None),
    (
        "nybble.checkpoint",
        "Checkpoint tools",
        [
            "quantize_checkpoint",
            "dequantize_checkpoint",
            "merge_adapter",
            "inspect_checkpoint",
        ],
    ),
    ("nybble", "The memory estimator", ["estimate_memory"]),
    ("nybble.memory", None, ["MemoryEstimate"]),
]
#: Members of a class worth listing: public methods and properties with a docstring.
SKIP = {"__init__"}


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__ or "").strip()


def _signature(name: str, obj: Any) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name


def _class(name: str, cls: type) -> list[str]:
    out = [f"### class `{_signature(name, cls)}`", "", _doc(cls), ""]
    init_doc = _doc(cls.__init__) if "__init__" in vars(cls) else ""
    if init_doc:
        out += [init_doc, ""]
    for attr, member in vars(cls).items():
        if attr.startswith("_") or attr in SKIP:
            continue
        if isinstance(member, property):
            if member.__doc__:
                out += [f"- `{name}.{attr}` (property): {_doc(member)}"]
        elif isinstance(member, (classmethod, staticmethod)):
            fn = member.__func__
            if fn.__doc__:
                out += [f"- `{name}.{_signature(attr, fn)}`: {_doc(fn)}"]
        elif inspect.isfunction(member) and member.__doc__:
            out += [f"- `{name}.{_signature(attr, member)}`: {_doc(member)}"]
    return [*out, ""]


def _entry(name: str, obj: Any) -> list[str]:
    if inspect.isclass(obj):
        return _class(name, obj)
    if callable(obj):
        return [f"### `{_signature(name, obj)}`", "", _doc(obj), ""]
    return [f"### `{name}`", "", f"`{obj!r}`", ""]


def _cli() -> list[str]:
    from nybble.cli import build_parser

    parser = build_parser()
    out = ["## The command line", "", "```text", parser.format_help().rstrip(), "```", ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, sub_parser in sub.choices.items():
        out += [
            f"### `nybble {command}`",
            "",
            "```text",
            sub_parser.format_help().rstrip(),
            "```",
            "",
        ]
    return out


#: The Python that writes the page: argparse's help text differs between versions.
PYTHON = (3, 11)


def render() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal: a fixed width
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings and the command line's help by `docs/make_api.py`",
        "(do not edit by hand; `tests/docs/test_docs.py` checks it is current, on Python 3.11,",
        "whose argparse wrote the help text below). The concepts are in",
        "[formats.md](formats.md), [lora.md](lora.md), [architecture.md](architecture.md).",
        "",
    ]
    described: set[str] = set()
    for module_name, title, names in SECTIONS:
        module = importlib.import_module(module_name)
        if title:
            lines += [f"## {title} (`{module_name}`)", ""]
            if module_name not in described:
                lines += [_doc(module), ""]
                described.add(module_name)
        for name in names if names is not None else list(module.__all__):
            lines += _entry(name, getattr(module, name))
    with contextlib.redirect_stdout(io.StringIO()):
        lines += _cli()
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="exit 1 if api.md is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE} is out of date: run python docs/make_api.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
