"""nybble's operators in torch (`torch.ops.nybble.*`), declared once: each with its schema, a
fake implementation (shapes and dtypes without data, for torch.compile and meta tensors), the
CPU and CUDA kernels of `_kernels` registered per device, and autograd where it applies.

A quantized weight W [out, in] travels as seven arguments, in this order:
`codes` (uint8 [ceil(n/2)], nybble's packing: element 2k in the low nibble), `absmax`
(float32 [nblocks]; uint8 [nblocks] under double quantization), `absmax2` (None; float32
[ceil(nblocks/256)] under double quantization), `offset` (the nested offset, 0.0 without),
`shape` ([out, in]), `blocksize`, `codebook` ("nf4" or "fp4").

| op | computes |
|---|---|
| `quantize(x, blocksize, codebook) -> (codes, absmax)` | blockwise codes of any float tensor |
| `dequantize(W..., dtype) -> w` | W [out, in] in float32/float16/bfloat16 |
| `matmul(x, W...) -> y` | x @ Wᵀ, [..., in] -> [..., out] (differentiable in x) |
| `matmul_t(g, W...) -> y` | g @ W, [..., out] -> [..., in] |
| `qlora_linear(x, keep, W..., A, B, s, bias) -> y` | x Wᵀ + s·(x ⊙ keep) Aᵀ Bᵀ + bias |
| `qlora_linear_backward(dy, x, keep, W..., A, B, s) -> (dx, dA, dB)` | its gradients |

`matmul` is differentiable in x, `qlora_linear` in x, A, B and the bias (its backward is
`qlora_linear_backward`); W is frozen. `keep` is the LoRA branch's dropout as a tensor of
x's shape (0 where dropped, 1/(1-p) where kept), or None. Bad arguments raise ValueError
naming the op, the argument, what it must be and what it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import formats
from . import _fastpath, _kernels
from ._kernels import Weight

NAMESPACE = "nybble"

_W = (
    "Tensor codes, Tensor absmax, Tensor? absmax2, float offset, int[] shape, int blocksize, "
    "str codebook"
)
SCHEMAS = {
    "quantize": "(Tensor x, int blocksize, str codebook) -> (Tensor, Tensor)",
    "dequantize": f"({_W}, ScalarType dtype) -> Tensor",
    "matmul": f"(Tensor x, {_W}) -> Tensor",
    "matmul_t": f"(Tensor grad, {_W}) -> Tensor",
    "qlora_linear": (
        f"(Tensor x, Tensor? keep, {_W}, Tensor lora_a, Tensor lora_b, float scaling, "
        "Tensor? bias) -> Tensor"
    ),
    "qlora_linear_backward": (
        f"(Tensor grad_y, Tensor x, Tensor? keep, {_W}, Tensor lora_a, Tensor lora_b, "
        "float scaling) -> (Tensor, Tensor, Tensor)"
    ),
}

#: The dtypes an activation may have, and those a dequantized weight may have.
ACTIVATION_DTYPES = _fastpath.FLOAT_DTYPES
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The formats the ops take (the 4-bit ones the kernels and the GEMV read).
CODEBOOKS = ("nf4", "fp4")


def _fail(op: str, what: str, problem: str) -> ValueError:
    return ValueError(f"nybble::{op}: {what} {problem}")


def _dtype_list(dtypes: Sequence[torch.dtype]) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def weight(
    op: str,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor | None,
    offset: float,
    shape: Sequence[int],
    blocksize: int,
    codebook: str,
) -> Weight:
    """The weight arguments checked (dtypes, sizes, one device) as a `_kernels.Weight`."""
    if len(shape) != 2 or any(int(d) < 0 for d in shape):
        raise _fail(op, "shape", f"must be [out_features, in_features], got {list(shape)}")
    rows, cols = int(shape[0]), int(shape[1])
    try:
        bs = formats.check_blocksize(blocksize)
    except ValueError as e:
        raise _fail(op, "blocksize", str(e).removeprefix("blocksize ")) from None
    if codebook not in CODEBOOKS:
        raise _fail(op, "codebook", f"must be one of {', '.join(CODEBOOKS)}, got {codebook!r}")
    n = rows * cols
    nblocks = -(-n // bs)
    if codes.dtype != torch.uint8 or codes.dim() != 1 or codes.numel() != -(-n // 2):
        raise _fail(
            op,
            "codes",
            f"must be uint8 [{-(-n // 2)}] (two 4-bit codes a byte for a {rows}x{cols} "
            f"weight), got {str(codes.dtype).removeprefix('torch.')} {list(codes.shape)}",
        )
    if absmax2 is None:
        if absmax.dtype != torch.float32 or absmax.dim() != 1 or absmax.numel() != nblocks:
            raise _fail(
                op,
                "absmax",
                f"must be float32 [{nblocks}] (one scale per {bs} elements), got "
                f"{str(absmax.dtype).removeprefix('torch.')} {list(absmax.shape)}",
            )
    else:
        want = -(-nblocks // formats.NESTED_BLOCKSIZE)
        if absmax.dtype != torch.uint8 or absmax.dim() != 1 or absmax.numel() != nblocks:
            raise _fail(
                op,
                "absmax",
                f"must be uint8 [{nblocks}] under double quantization (absmax2 given), got "
                f"{str(absmax.dtype).removeprefix('torch.')} {list(absmax.shape)}",
            )
        if absmax2.dtype != torch.float32 or absmax2.dim() != 1 or absmax2.numel() != want:
            raise _fail(
                op,
                "absmax2",
                f"must be float32 [{want}], got "
                f"{str(absmax2.dtype).removeprefix('torch.')} {list(absmax2.shape)}",
            )
    if not abs(offset) < float("inf"):  # NaN or ±inf
        raise _fail(op, "offset", f"must be finite, got {offset}")
    for name, t in (("absmax", absmax), ("absmax2", absmax2)):
        if t is not None and t.device != codes.device:
            raise _fail(op, name, f"is on {t.device}, codes on {codes.device}")
    cb = formats.check_codebook(codebook)
    return Weight(codes, absmax, absmax2, float(offset), (rows, cols), bs, cb)


def activation(op: str, what: str, x: torch.Tensor, width: int, w: Weight) -> None:
    """x is a float tensor [..., width] on the weight's device."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise _fail(
            op,
            what,
            f"must be {_dtype_list(ACTIVATION_DTYPES)}, got {str(x.dtype).removeprefix('torch.')}",
        )
    if x.dim() == 0 or x.shape[-1] != width:
        raise _fail(op, what, f"must have shape [..., {width}], got {list(x.shape)}")
    if x.device != w.codes.device:
        raise _fail(op, what, f"is on {x.device}, the weight on {w.codes.device}")


def adapter(op: str, w: Weight, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
    """A [r, in] and B [out, r], float, on the weight's device."""
    r = lora_a.shape[0] if lora_a.dim() == 2 else -1
    if lora_a.dim() != 2 or lora_a.shape[1] != w.cols:
        raise _fail(op, "lora_a", f"must be [r, {w.cols}], got {list(lora_a.shape)}")
    if lora_b.dim() != 2 or tuple(lora_b.shape) != (w.rows, r):
        raise _fail(op, "lora_b", f"must be [{w.rows}, {r}], got {list(lora_b.shape)}")
    for name, t in (("lora_a", lora_a), ("lora_b", lora_b)):
        if t.dtype not in ACTIVATION_DTYPES:
            raise _fail(op, name, f"must be a float tensor, got {t.dtype}")
        if t.device != w.codes.device:
            raise _fail(op, name, f"is on {t.device}, the weight on {w.codes.device}")


def _keep(op: str, keep: torch.Tensor | None, x: torch.Tensor) -> None:
    if keep is not None and (keep.shape != x.shape or keep.device != x.device):
        raise _fail(
            op,
            "keep",
            f"must have x's shape {list(x.shape)} on {x.device}, got {list(keep.shape)} on "
            f"{keep.device}",
        )
    if keep is not None and keep.dtype not in ACTIVATION_DTYPES:
        raise _fail(op, "keep", f"must be a float tensor, got {keep.dtype}")


# --- the checked calls, shared by the fake and the real implementations --------------------------


def _quantize_meta(x: torch.Tensor, blocksize: int, codebook: str) -> tuple[int, int]:
    if x.dtype not in ACTIVATION_DTYPES:
        raise _fail(
            "quantize",
            "x",
            f"must be {_dtype_list(ACTIVATION_DTYPES)}, got {str(x.dtype).removeprefix('torch.')}",
        )
    try:
        bs = formats.check_blocksize(blocksize)
    except ValueError as e:
        raise _fail("quantize", "blocksize", str(e).removeprefix("blocksize ")) from None
    if codebook not in CODEBOOKS:
        raise _fail("quantize", "codebook", f"must be one of {', '.join(CODEBOOKS)}")
    n = x.numel()
    return (n + 1) // 2, (n + bs - 1) // bs


def _dequantize_dtype(dtype: torch.dtype) -> None:
    if dtype not in WEIGHT_DTYPES:
        raise _fail("dequantize", "dtype", f"must be {_dtype_list(WEIGHT_DTYPES)}, got {dtype}")


# --- registration ----------------------------------------------------------------------------


def _qualname(name: str) -> str:
    return f"{NAMESPACE}::{name}"


def _define() -> None:
    for name, schema in SCHEMAS.items():
        torch.library.define(_qualname(name), schema)

    # quantize ---------------------------------------------------------------------------------
    def quantize_fake(
        x: torch.Tensor, blocksize: int, codebook: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nbytes, nblocks = _quantize_meta(x, blocksize, codebook)
        return (
            x.new_empty((nbytes,), dtype=torch.uint8),
            x.new_empty((nblocks,), dtype=torch.float32),
        )

    def quantize(
        x: torch.Tensor, blocksize: int, codebook: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _quantize_meta(x, blocksize, codebook)
        return _kernels.quantize(x, blocksize, codebook)

    # dequantize -------------------------------------------------------------------------------
    def dequantize_fake(*args: Any) -> torch.Tensor:
        w = weight("dequantize", *args[:7])
        _dequantize_dtype(args[7])
        return w.codes.new_empty(w.shape, dtype=args[7])

    def dequantize(*args: Any) -> torch.Tensor:
        w = weight("dequantize", *args[:7])
        _dequantize_dtype(args[7])
        return _kernels.dequantize(w, args[7])

    # matmul, matmul_t -------------------------------------------------------------------------
    def matmul_checked(op: str, transpose: bool, x: torch.Tensor, *wargs: Any) -> tuple[Any, ...]:
        w = weight(op, *wargs)
        width = w.cols if transpose else w.rows
        activation(op, "x" if transpose else "grad", x, width, w)
        return w, (w.rows if transpose else w.cols)

    for op, transpose in (("matmul", True), ("matmul_t", False)):

        def fake(x: torch.Tensor, *wargs: Any, op: str = op, transpose: bool = transpose) -> Any:
            _, out = matmul_checked(op, transpose, x, *wargs)
            return x.new_empty((*x.shape[:-1], out))

        def real(x: torch.Tensor, *wargs: Any, op: str = op, transpose: bool = transpose) -> Any:
            w, _ = matmul_checked(op, transpose, x, *wargs)
            return _kernels.matmul(x, w, transpose)

        torch.library.register_fake(_qualname(op), fake)
        torch.library.register_kernel(_qualname(op), ("cpu", "cuda"), real)

    def matmul_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, codes, absmax, absmax2, offset, shape, blocksize, codebook = inputs
        ctx.save_for_backward(codes, absmax, absmax2)
        ctx.meta = (offset, list(shape), blocksize, codebook)

    def matmul_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        codes, absmax, absmax2 = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.nybble.matmul_t(grad, codes, absmax, absmax2, *ctx.meta)
        return (dx, None, None, None, None, None, None, None)

    torch.library.register_autograd(
        _qualname("matmul"), matmul_backward, setup_context=matmul_setup
    )

    # qlora_linear -----------------------------------------------------------------------------
    def qlora_checked(args: tuple[Any, ...]) -> Weight:
        x, keep = args[0], args[1]
        w = weight("qlora_linear", *args[2:9])
        lora_a, lora_b, _, bias = args[9:13]
        activation("qlora_linear", "x", x, w.cols, w)
        _keep("qlora_linear", keep, x)
        adapter("qlora_linear", w, lora_a, lora_b)
        if bias is not None and (tuple(bias.shape) != (w.rows,) or bias.device != x.device):
            raise _fail(
                "qlora_linear",
                "bias",
                f"must be [{w.rows}] on {x.device}, got {list(bias.shape)} on {bias.device}",
            )
        return w

    def qlora_linear_fake(*args: Any) -> torch.Tensor:
        w = qlora_checked(args)
        x = args[0]
        return x.new_empty((*x.shape[:-1], w.rows))

    def qlora_linear(*args: Any) -> torch.Tensor:
        w = qlora_checked(args)
        x, keep, lora_a, lora_b, scaling, bias = (args[0], args[1], *args[9:13])
        return _kernels.qlora_linear(x, keep, w, lora_a, lora_b, float(scaling), bias)

    def qlora_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, keep, codes, absmax, absmax2 = inputs[:5]
        lora_a, lora_b, scaling, bias = inputs[9:13]
        ctx.save_for_backward(x, keep, codes, absmax, absmax2, lora_a, lora_b)
        ctx.meta = (*inputs[5:9], float(scaling))
        ctx.bias_dtype = None if bias is None else bias.dtype

    def qlora_backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:
        x, keep, codes, absmax, absmax2, lora_a, lora_b = ctx.saved_tensors
        offset, shape, blocksize, codebook, scaling = ctx.meta
        needs = ctx.needs_input_grad
        dx = da = db = dbias = None
        if needs[0] or needs[9] or needs[10]:
            dx, da, db = torch.ops.nybble.qlora_linear_backward(
                grad_y, x, keep, codes, absmax, absmax2, offset, shape, blocksize, codebook,
                lora_a, lora_b, scaling,
            )  # fmt: skip
        if needs[12]:
            dbias = grad_y.reshape(-1, grad_y.shape[-1]).sum(0).to(ctx.bias_dtype)
        return (
            dx if needs[0] else None,
            None, None, None, None, None, None, None, None,
            da if needs[9] else None,
            db if needs[10] else None,
            None,
            dbias,
        )  # fmt: skip

    torch.library.register_autograd(
        _qualname("qlora_linear"), qlora_backward, setup_context=qlora_setup
    )

    # qlora_linear_backward --------------------------------------------------------------------
    def backward_checked(args: tuple[Any, ...]) -> Weight:
        grad_y, x, keep = args[:3]
        w = weight("qlora_linear_backward", *args[3:10])
        lora_a, lora_b = args[10:12]
        activation("qlora_linear_backward", "x", x, w.cols, w)
        activation("qlora_linear_backward", "grad_y", grad_y, w.rows, w)
        if tuple(grad_y.shape[:-1]) != tuple(x.shape[:-1]):
            raise _fail(
                "qlora_linear_backward",
                "grad_y",
                f"must have shape {[*x.shape[:-1], w.rows]}, got {list(grad_y.shape)}",
            )
        _keep("qlora_linear_backward", keep, x)
        adapter("qlora_linear_backward", w, lora_a, lora_b)
        return w

    def qlora_linear_backward_fake(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        backward_checked(args)
        x, lora_a, lora_b = args[1], args[10], args[11]
        return x.new_empty(x.shape), lora_a.new_empty(lora_a.shape), lora_b.new_empty(lora_b.shape)

    def qlora_linear_backward(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = backward_checked(args)
        grad_y, x, keep, lora_a, lora_b, scaling = (*args[:3], *args[10:13])
        return _kernels.qlora_linear_backward(grad_y, x, keep, w, lora_a, lora_b, float(scaling))

    for name, fake_impl, real_impl in (
        ("quantize", quantize_fake, quantize),
        ("dequantize", dequantize_fake, dequantize),
        ("qlora_linear", qlora_linear_fake, qlora_linear),
        ("qlora_linear_backward", qlora_linear_backward_fake, qlora_linear_backward),
    ):
        torch.library.register_fake(_qualname(name), fake_impl)
        torch.library.register_kernel(_qualname(name), ("cpu", "cuda"), real_impl)


def _defined() -> bool:
    try:
        torch.ops.nybble.matmul  # noqa: B018 (defined by an earlier import of this module)
    except (AttributeError, RuntimeError):
        return False
    return True


if not _defined():
    _define()


__all__ = ["ACTIVATION_DTYPES", "CODEBOOKS", "SCHEMAS", "WEIGHT_DTYPES", "activation", "weight"]
