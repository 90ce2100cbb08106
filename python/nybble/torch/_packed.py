"""`NF4Weight`: a frozen NF4 weight W [out, in] as one torch tensor, so that torch.distributed's
FSDP2 (`fully_shard`) shards it by rows and all-gathers it as packed 4-bit data.

The tensor is a wrapper subclass: it reports W's shape (or a piece of W's rows) and dtype
uint8 (so that `module.to(dtype)` and FSDP's mixed precision leave it alone), and holds
nybble's arrays for those rows as inner tensors:

  codes    uint8, the packed codes of the blocks that cover the rows (nybble's packing)
  absmax   float32 scales of those blocks, or their uint8 nested codes (double quantization)
  absmax2  float32 nested scales of the 256-block groups covering those blocks (or None)

A piece of rows [a, b) holds the whole blocks (and groups) that its elements touch, so where a
row boundary falls inside a block, both neighbours keep that block's bytes and scale: a piece
is always exact, and W is put back together bit for bit from its pieces. Row slices, `split`
and `chunk` (what `fully_shard` calls) make such pieces; `copy_`, `to(device)`, `pin_memory`,
`view`, `as_strided`, `detach` and `empty_like` are what FSDP2 does with them, and are the
only operations there are (anything else, e.g. arithmetic, is a TypeError naming the op).

FSDP2's extension (torch >= 2.5): `fsdp_pre_all_gather` gives each rank's arrays, padded to
the longest rank's, as the all-gather inputs (uint8 codes, the scales in their own dtype: a
4.5-bit weight is gathered as 4.5 bits, never as 16); `fsdp_post_all_gather` builds the whole
weight from the gathered arrays. Where the ranks' pieces meet at block (and group)
boundaries (the large layers: rows per rank times in a multiple of blocksize, and of 256
blocks for the nested scales), the gathered arrays are the whole weight's arrays and are
used in place; otherwise they are copied into place.

A weight may also be built holding only some rows of W with the rest left out (`held`): a
rank that quantized only its own rows (`nybble.torch.distributed.load_sharded`) holds such a
weight, which `fully_shard` on the same mesh splits into the rank's piece without the other
rows ever existing there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from ..formats import NESTED_BLOCKSIZE

aten = torch.ops.aten

#: The arrays of a weight, in the order they are gathered.
KINDS = ("codes", "absmax", "absmax2")


@dataclass(frozen=True)
class Layout:
    """The whole weight's format: W [rows, cols] in blocks of `blocksize`, optionally with
    double-quantized scales (nested offset `offset`); `weight_dtype` is the dtype quantized."""

    rows: int
    cols: int
    blocksize: int
    double_quant: bool
    offset: float
    weight_dtype: torch.dtype

    @property
    def n(self) -> int:
        return self.rows * self.cols

    @property
    def nblocks(self) -> int:
        return -(-self.n // self.blocksize)

    def length(self, kind: str) -> int:
        """The whole weight's length of one array (in its elements)."""
        return self.span(0, self.rows)[kind][1]

    def dtype(self, kind: str) -> torch.dtype:
        if kind == "codes":
            return torch.uint8
        if kind == "absmax":
            return torch.uint8 if self.double_quant else torch.float32
        return torch.float32

    def kinds(self) -> tuple[str, ...]:
        return KINDS if self.double_quant else KINDS[:2]

    def span(self, a: int, b: int) -> dict[str, tuple[int, int]]:
        """Where rows [a, b) lie in each array: the codes bytes, scales and nested scales of
        the blocks (and groups) their elements touch, as [start, stop) per array."""
        if b <= a:
            return {k: (0, 0) for k in KINDS}
        e0, e1 = a * self.cols, b * self.cols
        k0, k1 = e0 // self.blocksize, -(-e1 // self.blocksize)
        out = {
            "codes": (k0 * self.blocksize // 2, -(-min(k1 * self.blocksize, self.n) // 2)),
            "absmax": (k0, k1),
            "absmax2": (0, 0),
        }
        if self.double_quant:
            out["absmax2"] = (k0 // NESTED_BLOCKSIZE, -(-k1 // NESTED_BLOCKSIZE))
        return out


class _Box:
    """What the wrappers of one weight share: its layout, the rows it stands for (`rows`,
    global [a, b)), the rows whose arrays it holds (`held`: `rows`, or for a weight loaded
    per rank only that rank's rows, or empty), and the arrays of the held rows. Views
    (detach, view, as_strided, whole slices) share a box, so that `copy_` into a view writes
    the base, as FSDP2 expects."""

    __slots__ = ("arrays", "held", "layout", "rows")

    def __init__(
        self,
        layout: Layout,
        rows: tuple[int, int],
        held: tuple[int, int],
        arrays: dict[str, torch.Tensor | None],
    ) -> None:
        self.layout = layout
        self.rows = rows
        self.held = held
        self.arrays = arrays

    @property
    def device(self) -> torch.device:
        codes = self.arrays["codes"]
        assert codes is not None
        return codes.device

    def map(self, fn: Any) -> dict[str, torch.Tensor | None]:
        return {k: None if t is None else fn(t) for k, t in self.arrays.items()}

    def piece(self, a: int, b: int) -> _Box:
        """The box of rows [a, b) (global), sharing this one's arrays (views)."""
        h0, h1 = self.held
        if not (self.rows[0] <= a <= b <= self.rows[1]):
            raise ValueError(
                f"NF4Weight: rows [{a}, {b}) are outside [{self.rows[0]}, {self.rows[1]})"
            )
        if (h0 <= a and b <= h1) or a == b:
            mine = self.layout.span(h0, h1)
            want = self.layout.span(a, b)
            arrays: dict[str, torch.Tensor | None] = {}
            for kind, t in self.arrays.items():
                if t is None:
                    arrays[kind] = None
                    continue
                s, e = want[kind]
                base = mine[kind][0]
                arrays[kind] = t[s - base : e - base] if e > s else t[:0]
            return _Box(self.layout, (a, b), (a, b), arrays)
        if b <= h0 or a >= h1:  # rows this rank never loaded: a placeholder without data
            return _Box(
                self.layout,
                (a, b),
                (a, a),
                {k: None if t is None else t[:0] for k, t in self.arrays.items()},
            )
        raise ValueError(
            f"NF4Weight: rows [{a}, {b}) are partly outside the rows this weight holds "
            f"[{h0}, {h1}) (it was loaded for another split of the rows)"
        )


def empty_arrays(
    layout: Layout, a: int, b: int, device: Any, fill: bool = False
) -> dict[str, torch.Tensor | None]:
    span = layout.span(a, b)
    make = torch.zeros if fill else torch.empty
    return {
        k: make(span[k][1] - span[k][0], dtype=layout.dtype(k), device=device)
        if k in layout.kinds()
        else None
        for k in KINDS
    }


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


class NF4Weight(torch.Tensor):
    """A frozen NF4 weight (or a piece of its rows) as a torch tensor; see the module's
    docstring. Build one with `NF4Weight.from_arrays` (or `Linear4bit.pack_()`)."""

    _box: _Box

    @staticmethod
    def __new__(cls, box: _Box, shape: Sequence[int] | None = None) -> NF4Weight:
        if shape is None:
            shape = (box.rows[1] - box.rows[0], box.layout.cols)
        shape = tuple(int(d) for d in shape)
        if _numel(shape) != (box.rows[1] - box.rows[0]) * box.layout.cols:
            raise ValueError(f"NF4Weight: shape {list(shape)} does not match rows {box.rows}")
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * max(shape[i + 1], 1)
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=strides, dtype=torch.uint8, device=box.device, requires_grad=False
        )
        t._box = box
        return t

    def __init__(self, box: _Box, shape: Sequence[int] | None = None) -> None:
        pass

    @classmethod
    def from_arrays(
        cls,
        layout: Layout,
        codes: torch.Tensor,
        absmax: torch.Tensor,
        absmax2: torch.Tensor | None,
        held: tuple[int, int] | None = None,
    ) -> NF4Weight:
        """W [rows, cols] from its arrays: the whole weight's (held=None), or only those of
        rows `held` = [a, b) (the arrays `Layout.span(a, b)` names)."""
        a, b = held if held is not None else (0, layout.rows)
        if not 0 <= a <= b <= layout.rows:
            raise ValueError(f"NF4Weight: held rows [{a}, {b}) outside [0, {layout.rows})")
        span = layout.span(a, b)
        arrays: dict[str, torch.Tensor | None] = {
            "codes": codes,
            "absmax": absmax,
            "absmax2": absmax2,
        }
        for kind in KINDS:
            t = arrays[kind]
            if kind not in layout.kinds():
                if t is not None:
                    raise ValueError("NF4Weight: absmax2 given without double quantization")
                continue
            want = span[kind][1] - span[kind][0]
            if t is None or t.dtype != layout.dtype(kind) or t.dim() != 1 or t.numel() != want:
                got = "None" if t is None else f"{t.dtype} {list(t.shape)}"
                raise ValueError(
                    f"NF4Weight: {kind} must be {layout.dtype(kind)} [{want}] for rows [{a}, {b}), "
                    f"got {got}"
                )
            if t.device != codes.device:
                raise ValueError(f"NF4Weight: {kind} is on {t.device}, codes on {codes.device}")
        box = _Box(
            layout,
            (0, layout.rows),
            (a, b),
            {k: (None if t is None else t.contiguous()) for k, t in arrays.items()},
        )
        return cls(box)

    # --- what the layer reads ----------------------------------------------------------------

    @property
    def nf4_layout(self) -> Layout:
        return self._box.layout

    @property
    def rows_held(self) -> tuple[int, int]:
        return self._box.held

    def is_whole(self) -> bool:
        box = self._box
        return box.rows == (0, box.layout.rows) and box.held == box.rows

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes, absmax, absmax2) of the whole weight; a ValueError where this tensor is a
        piece of it (FSDP2's shard outside forward, or a weight loaded for another rank)."""
        box = self._box
        if not self.is_whole():
            raise ValueError(
                f"this NF4 weight holds rows [{box.held[0]}, {box.held[1]}) of "
                f"[0, {box.layout.rows}): it is one rank's shard (FSDP gathers it whole "
                "inside the model's forward and backward; a weight loaded per rank by "
                "load_sharded must be sharded with shard_model on the same mesh first)"
            )
        codes, absmax, absmax2 = (box.arrays[k] for k in KINDS)
        assert codes is not None and absmax is not None
        return codes, absmax, absmax2

    def __repr__(self) -> str:  # type: ignore[override]
        box = self._box
        L = box.layout
        dq = ", double_quant" if L.double_quant else ""
        return (
            f"NF4Weight(rows=[{box.rows[0]}, {box.rows[1]}) of {L.rows}, cols={L.cols}, "
            f"held=[{box.held[0]}, {box.held[1]}), blocksize={L.blocksize}{dq}, "
            f"device={self.device})"
        )

    # --- a traceable wrapper subclass (FSDP moves such parameters with swap_tensors) --------

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        box = self._box
        names = [f"_inner_{k}" for k in box.layout.kinds()]
        return names, (box.layout, box.rows, box.held, tuple(self.shape))

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any
    ) -> NF4Weight:
        layout, rows, held, shape = ctx
        arrays = {k: inner.get(f"_inner_{k}") for k in KINDS}
        return NF4Weight(_Box(layout, rows, held, arrays), shape)

    @property
    def _inner_codes(self) -> torch.Tensor | None:
        return self._box.arrays["codes"]

    @property
    def _inner_absmax(self) -> torch.Tensor | None:
        return self._box.arrays["absmax"]

    @property
    def _inner_absmax2(self) -> torch.Tensor | None:
        return self._box.arrays["absmax2"]

    # --- torch dispatch ------------------------------------------------------------------------

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None:
            raise TypeError(
                f"NF4Weight holds packed NF4 codes; {func} is not an operation on it "
                "(dequantize the layer's weight with Linear4bit.dequantize() for its values)"
            )
        return handler(*args, **kwargs)

    # --- FSDP2's all-gather extension -------------------------------------------------------------

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: Any,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        box = self._box
        L = box.layout
        world = mesh.size()
        rank = mesh.get_local_rank()
        if tuple(outer_size) != (L.rows, L.cols):
            raise ValueError(
                f"NF4Weight: FSDP gathers a [{', '.join(map(str, outer_size))}] parameter from "
                f"a [{L.rows}, {L.cols}] weight's shards"
            )
        per = _rows_per_rank(L, world)
        want = (rank * per, (rank + 1) * per)
        if box.rows != want or box.held != want:
            raise ValueError(
                f"NF4Weight: rank {rank} of {world} holds rows [{box.held[0]}, {box.held[1]}), "
                f"expected [{want[0]}, {want[1]}) (FSDP shards rows evenly)"
            )
        if world == 1:
            # FSDP copies only the first input of a one-rank mesh: the codes travel, the
            # scales (this rank's, which are the whole weight's) ride along in the metadata.
            return (_array(box, "codes"),), (L, 1, (box.arrays["absmax"], box.arrays["absmax2"]))
        inputs = []
        for kind in L.kinds():
            t = box.arrays[kind]
            assert t is not None
            longest = max(e - s for s, e in _rank_spans(L, world, kind))
            if t.numel() < longest:
                t = torch.cat([t, t.new_zeros(longest - t.numel())])
            inputs.append(t)
        return tuple(inputs), (L, world, None)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        L, world, local = metadata
        arrays: dict[str, torch.Tensor | None] = {k: None for k in KINDS}
        fresh: list[torch.Tensor] = []
        if world == 1:
            if out is not None:
                return None
            arrays["codes"] = all_gather_outputs[0].view(-1)
            arrays["absmax"], arrays["absmax2"] = local
            return NF4Weight(_Box(L, (0, L.rows), (0, L.rows), arrays)), ()
        target = out._box.arrays if isinstance(out, NF4Weight) else None
        for kind, output in zip(L.kinds(), all_gather_outputs, strict=True):
            output = output.view(-1)
            per = output.numel() // world
            spans = _rank_spans(L, world, kind)
            if _contiguous(spans, per, L.length(kind)):
                arrays[kind] = output  # the gathered array is the whole weight's, in place
                continue
            whole = target[kind] if target is not None else None
            if whole is None:
                whole = torch.empty(L.length(kind), dtype=output.dtype, device=output.device)
                fresh.append(whole)
            # Autograd saved these tensors in the forward; FSDP refills them for the backward
            # (as it does its own outputs) without counting that as a change.
            with torch.no_grad(), _unsafe_preserve_version_counter(whole):
                for r, (s, e) in enumerate(spans):
                    if e > s:
                        whole[s:e].copy_(output[r * per : r * per + (e - s)])
            arrays[kind] = whole
        if out is not None:
            return None
        box = _Box(L, (0, L.rows), (0, L.rows), arrays)
        return NF4Weight(box), tuple(fresh)


def _array(box: _Box, kind: str) -> torch.Tensor:
    t = box.arrays[kind]
    assert t is not None
    return t


def _rows_per_rank(layout: Layout, world: int) -> int:
    if layout.rows % world:
        raise ValueError(
            f"NF4Weight: {layout.rows} rows do not split evenly over {world} ranks (FSDP2 "
            "pads uneven shards, which a packed 4-bit weight cannot be)"
        )
    return layout.rows // world


def _rank_spans(layout: Layout, world: int, kind: str) -> list[tuple[int, int]]:
    per = _rows_per_rank(layout, world)
    return [layout.span(r * per, (r + 1) * per)[kind] for r in range(world)]


def _contiguous(spans: list[tuple[int, int]], per: int, length: int) -> bool:
    """Whether the ranks' pieces of an array, each `per` long, laid end to end are the array."""
    pos = 0
    for s, e in spans:
        if s != pos or e - s != per:
            return False
        pos = e
    return pos == length


# --- the operations FSDP2 (and nn.Parameter, DTensor) apply ------------------------------------


def _rewrap(t: NF4Weight, shape: Sequence[int] | None = None) -> NF4Weight:
    return NF4Weight(t._box, t.shape if shape is None else shape)


def _infer(shape: Sequence[int], numel: int) -> list[int]:
    dims = [int(d) for d in shape]
    if dims.count(-1) == 1:
        known = _numel([d for d in dims if d != -1])
        dims[dims.index(-1)] = numel // known if known else 0
    return dims


def _view(t: NF4Weight, size: Sequence[int]) -> NF4Weight:
    dims = _infer(size, t.numel())
    if _numel(dims) != t.numel():
        raise ValueError(f"NF4Weight: cannot view {list(t.shape)} as {list(size)}")
    return _rewrap(t, dims)


def _as_strided(
    t: NF4Weight, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None
) -> NF4Weight:
    out = _view(t, size)
    if tuple(stride) != out.stride() or (storage_offset or 0) != 0:
        raise ValueError("NF4Weight: only contiguous views of a whole weight or piece exist")
    return out


def _row_span(t: NF4Weight) -> tuple[int, int]:
    return t._box.rows


def _rows(t: NF4Weight, start: int, stop: int) -> NF4Weight:
    """Rows [start, stop) of t (local indices) as a piece (2-D t)."""
    a0 = _row_span(t)[0]
    if t.dim() != 2:
        raise ValueError(f"NF4Weight: row pieces are cut from the 2-D weight, not {list(t.shape)}")
    return NF4Weight(t._box.piece(a0 + start, a0 + stop))


def _slice(
    t: NF4Weight, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1
) -> NF4Weight:
    size = t.shape[dim]
    s = 0 if start is None else (start + size if start < 0 else start)
    e = size if end is None else (end + size if end < 0 else end)
    s, e = max(0, min(s, size)), max(0, min(e, size))
    if step != 1:
        raise ValueError("NF4Weight: slices with a step are not pieces of a weight")
    if s == 0 and e >= size:
        return _rewrap(t)
    if dim != 0:
        raise ValueError("NF4Weight: a weight is cut into pieces of rows (dim 0) only")
    return _rows(t, s, e)


def _split(t: NF4Weight, split_size: int, dim: int = 0) -> list[NF4Weight]:
    if dim != 0:
        raise ValueError("NF4Weight: a weight splits into pieces of rows (dim 0) only")
    n = t.shape[0]
    return [_rows(t, i, min(i + split_size, n)) for i in range(0, n, split_size)] or [
        _rows(t, 0, 0)
    ]


def _split_sizes(t: NF4Weight, sizes: Sequence[int], dim: int = 0) -> list[NF4Weight]:
    if dim != 0:
        raise ValueError("NF4Weight: a weight splits into pieces of rows (dim 0) only")
    out, pos = [], 0
    for s in sizes:
        out.append(_rows(t, pos, pos + int(s)))
        pos += int(s)
    return out


def _like(t: NF4Weight, shape: Sequence[int] | None, device: Any, fill: bool) -> NF4Weight:
    """A new weight of t's rows with new arrays (zeros or uninitialized) on `device`; of
    another shape, a placeholder without arrays for `copy_` to fill."""
    box = t._box
    device = torch.device(device) if device is not None else t.device
    if shape is None or tuple(int(d) for d in shape) == tuple(t.shape):
        arrays = empty_arrays(box.layout, *box.held, device=device, fill=fill)
        return NF4Weight(_Box(box.layout, box.rows, box.held, arrays), t.shape)
    dims = [int(d) for d in shape]
    rows = (
        dims[0] if len(dims) == 2 else (_numel(dims) // box.layout.cols if box.layout.cols else 0)
    )
    arrays = empty_arrays(box.layout, 0, 0, device=device)
    new = _Box(box.layout, (0, rows), (0, 0), arrays)
    return NF4Weight(new, dims if _numel(dims) == rows * box.layout.cols else None)


def _new_zeros(t: NF4Weight, size: Sequence[int], **kw: Any) -> NF4Weight:
    return _like(t, size, kw.get("device"), fill=True)


def _new_empty(t: NF4Weight, size: Sequence[int], **kw: Any) -> NF4Weight:
    return _like(t, size, kw.get("device"), fill=False)


def _empty_like(t: NF4Weight, **kw: Any) -> NF4Weight:
    return _like(t, None, kw.get("device"), fill=False)


def _zeros_like(t: NF4Weight, **kw: Any) -> NF4Weight:
    return _like(t, None, kw.get("device"), fill=True)


def _copy_(dst: NF4Weight, src: Any, non_blocking: bool = False) -> NF4Weight:
    if not isinstance(src, NF4Weight):
        raise TypeError(
            "NF4Weight: only another NF4Weight can be copied into one (quantize a float "
            "weight with Linear4bit.quantize_)"
        )
    if src._box.layout != dst._box.layout or src.numel() != dst.numel():
        raise ValueError("NF4Weight: copy_ between weights of different formats or sizes")
    device = dst.device
    box = dst._box
    box.arrays = src._box.map(lambda a: a.to(device, non_blocking=non_blocking, copy=True))
    box.rows = src._box.rows
    box.held = src._box.held
    return dst


def _to_copy(t: NF4Weight, **kw: Any) -> NF4Weight:
    dtype = kw.get("dtype")
    if dtype is not None and dtype != torch.uint8:
        raise TypeError(
            f"NF4Weight holds packed NF4 codes and cannot be cast to {dtype} "
            "(Linear4bit.dequantize() gives the weight's values)"
        )
    device = kw.get("device") or t.device
    pin = bool(kw.get("pin_memory"))
    nb = bool(kw.get("non_blocking"))

    def move(a: torch.Tensor) -> torch.Tensor:
        b = a.to(device, non_blocking=nb, copy=True)
        return b.pin_memory() if pin else b

    box = t._box
    return NF4Weight(_Box(box.layout, box.rows, box.held, box.map(move)), t.shape)


def _clone(t: NF4Weight, **kw: Any) -> NF4Weight:
    box = t._box
    return NF4Weight(_Box(box.layout, box.rows, box.held, box.map(torch.clone)), t.shape)


def _is_pinned(t: NF4Weight, device: Any = None) -> bool:
    return all(a.is_pinned() for a in t._box.arrays.values() if a is not None and a.numel())


def _pin_memory(t: NF4Weight, device: Any = None) -> NF4Weight:
    box = t._box
    return NF4Weight(
        _Box(box.layout, box.rows, box.held, box.map(lambda a: a.pin_memory())), t.shape
    )


_HANDLERS: dict[Any, Any] = {
    aten.detach.default: lambda t: _rewrap(t),
    aten.alias.default: lambda t: _rewrap(t),
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.as_strided.default: _as_strided,
    aten.slice.Tensor: _slice,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split_sizes,
    aten.new_zeros.default: _new_zeros,
    aten.new_empty.default: _new_empty,
    aten.empty_like.default: _empty_like,
    aten.zeros_like.default: _zeros_like,
    aten.copy_.default: _copy_,
    aten._to_copy.default: _to_copy,
    aten.clone.default: _clone,
    aten.is_pinned.default: _is_pinned,
    aten._pin_memory.default: _pin_memory,
}


__all__ = ["Layout", "NF4Weight"]
