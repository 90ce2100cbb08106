"""nybble's exception types. Bad values and shapes raise ValueError, unknown names KeyError;
the two kinds below carry what went wrong as attributes, so callers (and tests) read
`.index` or `.source` / `.field` rather than parsing the message."""

from __future__ import annotations

from typing import Any


class NonFiniteError(ValueError):
    """An input holds NaN or ±inf. `index` is the first bad flat (row-major) index; `what`
    names the argument. Raised the same way by the Rust core, the CUDA kernels and the oracle."""

    def __init__(self, index: int, what: str = "input") -> None:
        self.index = int(index)
        self.what = what
        super().__init__(f"{what} has a non-finite value (NaN or inf) at flat index {self.index}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.index, self.what))


class FormatError(ValueError):
    """A file or state dict is malformed or not understood. `source` names the file (or the
    state dict), `field` the key, tensor or JSON field at fault (None for the whole thing),
    `problem` says what is wrong with it."""

    def __init__(self, source: object, problem: str, field: str | None = None) -> None:
        self.source = str(source)
        self.field = field
        self.problem = problem
        where = self.source if field is None else f"{self.source}: {field}"
        super().__init__(f"{where}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.source, self.problem, self.field))
