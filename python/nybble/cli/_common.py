"""Helpers shared by the subcommands: output as table or JSON, atomic file writes."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from .._files import atomic_write

__all__ = ["CliError", "atomic_write", "format_table", "print_json"]


class CliError(Exception):
    """Bad input on the command line: printed as one line, exit code 1."""


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=_json_default)
    sys.stdout.write("\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "__dict__"):
        return vars(o)
    raise TypeError(f"cannot write {type(o).__name__} as JSON")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned table; numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str], src: Sequence[Any]) -> str:
        parts = []
        for i, c in enumerate(row):
            numeric = isinstance(src[i], (int, float)) and not isinstance(src[i], bool)
            parts.append(c.rjust(widths[i]) if numeric else c.ljust(widths[i]))
        return "  ".join(parts).rstrip()

    out = [line(cells[0], headers), "  ".join("-" * w for w in widths)]
    out += [line(cells[i + 1], row) for i, row in enumerate(rows)]
    return "\n".join(out)
