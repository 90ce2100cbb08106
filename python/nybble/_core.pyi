"""Type stubs of the Rust extension module (rust/py.rs)."""

import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]
U16 = npt.NDArray[np.uint16]
F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]

def quantize(
    x: F32 | F64 | U16, blocksize: int, codebook: str, bits16: str | None = None
) -> tuple[U8, F32]: ...
def dequantize_into(
    codes: U8,
    absmax: F32,
    blocksize: int,
    codebook: str,
    out: F32 | U16,
    bits16: str | None = None,
) -> None: ...
def to_blocks36(codes: U8, absmax: F32, n: int, codebook: str) -> U8: ...
def from_blocks36(buf: U8, n: int) -> tuple[U8, F32]: ...
def double_quantize(absmax: F32) -> tuple[tuple[U8, F32], float]: ...
def double_dequantize(codes: U8, absmax2: F32, offset: np.float32 | float) -> F32: ...
def codebook_values(codebook: str) -> list[float]: ...
def simd_level() -> str: ...
def kernel_sources() -> dict[str, str]: ...
def _panic(message: str) -> None: ...
def matmul(a: F32, b: F32, out: F32, alpha: float = 1.0, accumulate: bool = False) -> None: ...
def qmatmul_wt(
    x: F32,
    codes: U8,
    absmax: F32,
    shape: tuple[int, int],
    blocksize: int,
    codebook: str,
    out: F32,
    alpha: float = 1.0,
    accumulate: bool = False,
) -> None: ...
def qmatmul_w(
    dy: F32,
    codes: U8,
    absmax: F32,
    shape: tuple[int, int],
    blocksize: int,
    codebook: str,
    out: F32,
    alpha: float = 1.0,
    accumulate: bool = False,
) -> None: ...
def dora_row_norms_dense(w: F32, b: F32, a: F32, scale: float) -> F32: ...
def dora_row_norms_quantized(
    codes: U8,
    absmax: F32,
    shape: tuple[int, int],
    blocksize: int,
    codebook: str,
    b: F32,
    a: F32,
    scale: float,
) -> F32: ...
