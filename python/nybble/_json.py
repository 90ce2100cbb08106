"""Reading JSON that nybble did not write (config files, quantization states, data lines):
strict JSON (RFC 8259: no NaN or Infinity, and no number that Python's json reads as inf,
such as 1e999), bounded (file size, integer digits, nesting), every failure a FormatError
naming the source and the field."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from .errors import FormatError

#: The largest JSON file read whole (configs are kilobytes).
MAX_FILE_BYTES = 1 << 20
#: Integers with more digits are out of every range a config field has.
MAX_INT_DIGITS = 30


def loads(
    data: bytes | str, source: object, field: str | None = None, int_digits: int | None = None
) -> Any:
    """`data` as Python objects; FormatError(source, problem, field) for anything that is not
    strict JSON, for nesting deeper than Python follows, and with `int_digits` for integers
    of more digits (otherwise a huge integer is for the reader of its field to refuse, by
    name). A non-finite number names its path inside the document."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number JSON allows")

    def integer(text: str) -> int:
        if int_digits is not None and len(text.lstrip("-")) > int_digits:
            raise ValueError(f"an integer of {len(text)} digits is out of any range")
        return int(text)

    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(text, parse_constant=constant, parse_int=integer)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        problem = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise FormatError(source, f"not valid JSON ({problem})", field) from None
    inner = non_finite_field(value)
    if inner is not None:  # json reads a number beyond float64 (1e999) as inf
        where = inner if field is None else f"{field}.{inner}"
        raise FormatError(source, "a number beyond float64's range (read as inf)", where)
    return value


def read_file(path: str | os.PathLike[str], limit: int = MAX_FILE_BYTES) -> Any:
    """A JSON file: a regular file of at most `limit` bytes (opened without blocking, so a
    FIFO put in its place cannot hang the reader), parsed by `loads`."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FormatError(p, "not found") from None
    except OSError as e:
        raise FormatError(p, f"cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise FormatError(p, "not a regular file")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise FormatError(p, f"cannot be read ({e.strerror or e})") from None
    if len(data) > limit:
        raise FormatError(p, f"larger than {limit} bytes: not a config file")
    return loads(data, p)


def non_finite_field(value: Any) -> str | None:
    """The path (`rope_scaling.factor`, `layers[2]`) of the first non-finite float in parsed
    JSON, or None."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return path or "(the document)"
        if isinstance(v, dict):
            stack += [(f"{path}.{k}" if path else str(k), x) for k, x in reversed(v.items())]
        elif isinstance(v, list):
            stack += [(f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v)))]
    return None


__all__ = ["MAX_FILE_BYTES", "MAX_INT_DIGITS", "loads", "non_finite_field", "read_file"]
