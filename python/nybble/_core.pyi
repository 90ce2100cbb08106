"""Type stubs of the Rust extension module (rust/py.rs, rust/py_launch.rs)."""

from collections.abc import Callable
from typing import Any, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self

__all__ = [
    "BLOCK36_BYTES",
    "BLOCK36_VALUES",
    "MAX_BLOCKSIZE",
    "MIN_BLOCKSIZE",
    "NESTED_BLOCKSIZE",
    "GemvCall",
    "KernelLaunch",
    "_panic",
    "code_bits",
    "codebook_thresholds",
    "codebook_values",
    "dequantize_into",
    "dora_row_norms_dense",
    "dora_row_norms_quantized",
    "double_dequantize",
    "double_quantize",
    "fp4_magnitude_codes",
    "from_blocks36",
    "kernel_sources",
    "matmul",
    "matmul_isa",
    "qmatmul",
    "quantize",
    "simd_level",
    "to_blocks36",
    "zero_code",
]

_U8 = npt.NDArray[np.uint8]
_U16 = npt.NDArray[np.uint16]
_F32 = npt.NDArray[np.float32]
_F64 = npt.NDArray[np.float64]

# Format facts, each from its one definition in the core (rust/layout.rs, rust/double_quant.rs).
NESTED_BLOCKSIZE: int
MIN_BLOCKSIZE: int
MAX_BLOCKSIZE: int
BLOCK36_VALUES: int
BLOCK36_BYTES: int

def quantize(
    x: _F32 | _F64 | _U16, blocksize: int, codebook: str, bits16: str | None = None
) -> tuple[_U8, _F32]: ...
def dequantize_into(
    codes: _U8,
    absmax: _F32,
    blocksize: int,
    codebook: str,
    out: _F32 | _U16,
    bits16: str | None = None,
) -> None: ...
def to_blocks36(codes: _U8, absmax: _F32, n: int, codebook: str) -> _U8: ...
def from_blocks36(buf: _U8, n: int) -> tuple[_U8, _F32]: ...
def double_quantize(absmax: _F32) -> tuple[tuple[_U8, _F32], float]: ...
def double_dequantize(codes: _U8, absmax2: _F32, offset: np.float32 | float) -> _F32: ...
def codebook_values(codebook: str) -> list[float]: ...
def codebook_thresholds(codebook: str) -> list[float]: ...
def fp4_magnitude_codes() -> list[int]: ...
def zero_code(codebook: str) -> int: ...
def code_bits(codebook: str) -> int: ...
def simd_level() -> str: ...
def matmul_isa() -> str: ...
def kernel_sources() -> dict[str, str]: ...
def _panic(message: str) -> None: ...
def matmul(a: _F32, b: _F32, out: _F32, alpha: float = 1.0, accumulate: bool = False) -> None: ...
def qmatmul(
    x: _F32,
    codes: _U8,
    absmax: _F32,
    shape: tuple[int, int],
    blocksize: int,
    codebook: str,
    out: _F32,
    transpose: bool = True,
    alpha: float = 1.0,
    accumulate: bool = False,
) -> None: ...
def dora_row_norms_dense(w: _F32, b: _F32, a: _F32, scale: float) -> _F32: ...
def dora_row_norms_quantized(
    codes: _U8,
    absmax: _F32,
    shape: tuple[int, int],
    blocksize: int,
    codebook: str,
    b: _F32,
    a: _F32,
    scale: float,
) -> _F32: ...

@final
class KernelLaunch:
    """A kernel launch through the CUDA driver (unix only; RuntimeError where the driver
    library does not load). A grid is blocks along x, or a tuple of 1 to 3 (x, y, z)."""

    def __new__(
        cls,
        function: int,
        grid: int | tuple[int, ...],
        block: int,
        shared_mem: int,
        slots: list[int],
        varying: list[int],
        programmatic: bool,
    ) -> Self: ...
    @property
    def primed(self) -> bool: ...
    @staticmethod
    def programmatic_available() -> bool: ...
    def __call__(
        self, stream: int, *values: int, grid: int | tuple[int, ...] | None = None
    ) -> None: ...

@final
class GemvCall:
    """The fused GEMV's call for one weight, checks and launch in the core (unix only)."""

    def __new__(
        cls,
        keep: Any,
        array_type: type,
        current_stream: Callable[[], Any],
        allocate_ahead: Callable[..., None],
        dtypes: tuple[Any, Any],
        device: int,
        rows: int,
        cols: int,
    ) -> Self: ...
    def add(self, which: int, m: int, launch: KernelLaunch, ahead: list[Any]) -> None: ...
    @staticmethod
    def forget_outputs_ahead() -> None: ...
    def __call__(self, x: Any, out: Any = None) -> Any: ...
