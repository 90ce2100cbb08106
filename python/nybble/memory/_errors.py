"""The error types of `nybble.errors`, for the estimator.

The memory package is pure Python and the benchmark scripts load it on its own, as a
top-level package beside no compiled core (benchmarks/memory/compare.py); then the relative
import fails and `nybble/errors.py`, which needs nothing, is loaded from its file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

try:
    from ..errors import FormatError
except ImportError:  # loaded as a top-level package
    _path = Path(__file__).resolve().parents[1] / "errors.py"
    _spec = importlib.util.spec_from_file_location("_nybble_errors", _path)
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["_nybble_errors"] = _module
    _spec.loader.exec_module(_module)
    FormatError = _module.FormatError  # type: ignore[misc]

__all__ = ["FormatError"]
