"""The recording's arrays and its stand-in for CuPy: `RecordArray` (a shape, a dtype, strides
and an owner of its memory, no values) and `Namespace` (the backend's `xp`: array creation,
views, elementwise math, reductions and indexing). Each call allocates what CuPy 14 allocates
for it: the result; a reduction's workspace; a flat index for indexing by several arrays; the
pointer tables of a concatenation of many arrays. Views share their base's memory; memory is
freed when its last array goes, as CuPy frees it. Kernels (`_KernelModule`, what
`RecordingBackend.kernel_module` gives in place of the CUDA backend's compiled modules) launch
nothing."""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...formats import dtype_name, numpy_dtype

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from .. import Device
    from . import RecordingBackend

#: A whole-array reduction (CuPy's CUB block reduction in two passes) keeps 32 bytes per
#: block of up to this many elements (157696 bytes for 10092544 elements, as measured); one
#: of at most `_REDUCE_SMALL` elements makes none (measured: 68 none, 220 one).
_REDUCE_BLOCK = 2048
_REDUCE_SMALL = 128
#: CuPy concatenates more than this many arrays in one kernel reading tables of their
#: addresses (and of their sizes and strides when they differ in shape), when they are
#: smaller than this many bytes each on average (cupy/_core/_routines_manipulation.pyx).
_CONCAT_MANY = 8
_CONCAT_SMALL = 2 << 20


class Recorder(Protocol):
    """Where a recording goes: `alloc` returns a key that `free` is later called with."""

    def alloc(self, nbytes: int) -> int: ...

    def free(self, key: int) -> None: ...


class _Memory:
    """One allocation: recorded when made, freed when the last array over it goes."""

    __slots__ = ("key", "nbytes", "recorder")

    def __init__(self, recorder: Recorder | None, nbytes: int) -> None:
        self.recorder = recorder
        self.nbytes = nbytes
        self.key = recorder.alloc(nbytes) if recorder is not None and nbytes > 0 else None

    def __del__(self) -> None:
        if self.key is not None and self.recorder is not None:
            self.recorder.free(self.key)


_DTYPES: dict[Any, np.dtype[Any]] = {}
_C_STRIDES: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}


def _dtype(dtype: Any) -> np.dtype[Any]:
    """np.dtype(dtype), looked up once per dtype-like (the recording makes many arrays)."""
    found = _DTYPES.get(dtype)
    if found is None:
        found = _DTYPES[dtype] = np.dtype(dtype)
    return found


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    key = (shape, itemsize)
    found = _C_STRIDES.get(key)
    if found is None:
        strides = []
        step = itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        found = tuple(reversed(strides))
        if len(_C_STRIDES) < 65536:
            _C_STRIDES[key] = found
    return found


def _reduced(
    shape: tuple[int, ...], strides: tuple[int, ...]
) -> tuple[list[int], list[int]] | None:
    """CuPy's get_reduced_dims: size-1 axes dropped, axes that are contiguous with the next
    merged; None for an empty array."""
    rs: list[int] = []
    rt: list[int] = []
    prev = 0
    for n, s in zip(shape, strides, strict=True):
        if n == 0:
            return None
        if n == 1:
            continue
        if not rs or prev != n * s:
            rs.append(n)
            rt.append(s)
        else:
            rs[-1] *= n
            rt[-1] = s
        prev = s
    return rs, rt


def _is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    reduced = _reduced(shape, strides)
    if reduced is None:
        return True
    rs, rt = reduced
    return not rs or (len(rs) == 1 and rt[0] == itemsize)


def _nocopy_strides(a: RecordArray, newshape: tuple[int, ...]) -> tuple[int, ...] | None:
    """CuPy's _get_strides_for_nocopy_reshape: strides viewing `a` as `newshape`, or None when
    a copy is needed."""
    itemsize = a.dtype.itemsize
    size = a.size
    if size == 1:
        return (itemsize,) * len(newshape)
    if size == 0:
        return _c_strides(newshape, itemsize)
    reduced = _reduced(a.shape, a.strides)
    assert reduced is not None
    shape, strides = reduced
    ndim = len(shape)
    dim = 0
    last = shape[0] * strides[0]
    out = []
    for n in newshape:
        if n <= 1:
            out.append(last)
            continue
        if dim >= ndim or shape[dim] % n:
            return None
        shape[dim] //= n
        last = shape[dim] * strides[dim]
        out.append(last)
        if shape[dim] == 1:
            dim += 1
    return tuple(out)


def _k_strides(a: RecordArray) -> tuple[int, ...]:
    """Strides of a new array laid out like `a` (order "K"): its axes in the order of a's
    strides, largest first."""
    if a.c_contiguous:
        return _c_strides(a.shape, a.dtype.itemsize)
    order = sorted(range(a.ndim), key=lambda i: -abs(a.strides[i]))
    strides = [0] * a.ndim
    step = a.dtype.itemsize
    for i in reversed(order):
        strides[i] = step
        step *= max(a.shape[i], 1)
    return tuple(strides)


def _shape_of(args: Sequence[Any]) -> tuple[int, ...]:
    if len(args) == 1 and not isinstance(args[0], int):
        args = args[0]
    if all(type(n) is int for n in args):
        return tuple(args)
    return tuple(int(n) for n in args)


def _infer(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    if -1 not in shape:
        if math.prod(shape) != size:
            raise ValueError(f"cannot reshape an array of size {size} into shape {shape}")
        return shape
    known = math.prod(n for n in shape if n != -1)
    if shape.count(-1) > 1 or (known == 0 or size % known):
        raise ValueError(f"cannot reshape an array of size {size} into shape {shape}")
    return tuple(size // known if n == -1 else n for n in shape)


def _operand(x: Any) -> Any:
    """What numpy's promotion takes for an operand: a dtype, or a Python scalar (weak)."""
    if isinstance(x, RecordArray):
        return x.dtype
    if isinstance(x, (bool, int, float, complex)):
        return x
    return np.asarray(x).dtype


def _promote(dtype: np.dtype[Any], other: Any) -> np.dtype[Any]:
    """The result dtype of an operation between an array of `dtype` and `other` (NumPy 2's and
    CuPy 14's rules: a Python scalar takes the array's dtype where its kind fits, bfloat16
    included)."""
    if isinstance(other, bool):
        return dtype
    if isinstance(other, int) and dtype.kind in "iuf":
        return dtype
    if isinstance(other, float) and dtype.kind == "f":
        return dtype
    return np.result_type(dtype, _operand(other))


def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    return tuple(sorted(a % ndim if ndim else 0 for a in axis))


#: Index types that make a view (with None): basic indexing.
_BASIC = frozenset([slice, int, type(Ellipsis)])
#: The types of np.dtype objects (np.dtypes.Float32DType, ...): taken as they are.
_DTYPE_TYPES = frozenset(
    [type(np.dtype(t)) for t in np.typecodes["All"] if t not in "MmO"]
    + [type(numpy_dtype("bfloat16"))]
)


class _Flags:
    __slots__ = ("_a", "c_contiguous")

    def __init__(self, a: RecordArray) -> None:
        self._a = a
        self.c_contiguous = a.c_contiguous

    @property
    def f_contiguous(self) -> bool:
        a = self._a
        return _is_c_contiguous(a.shape[::-1], a.strides[::-1], a.dtype.itemsize)


class RecordArray:
    """An array of the recording backend: layout and memory, no values. Arithmetic returns
    new arrays (recorded), in-place arithmetic and assignment record nothing; reading a value
    gives 0 (the recording has none)."""

    __slots__ = (
        "__weakref__",
        "_c",
        "_mem",
        "_offset",
        "dtype",
        "nybble_backend",
        "shape",
        "strides",
    )

    #: numpy hands its binary operators with these arrays to them (their reflected forms).
    __array_ufunc__ = None
    __hash__ = None  # type: ignore[assignment]  # elementwise ==, as CuPy's

    def __init__(
        self,
        backend: RecordingBackend,
        shape: tuple[int, ...],
        dtype: Any,
        memory: _Memory | None = None,
        strides: tuple[int, ...] | None = None,
        offset: int = 0,
    ) -> None:
        self.nybble_backend = backend
        self.shape = shape
        self.dtype = dt = dtype if type(dtype) in _DTYPE_TYPES else _dtype(dtype)
        if strides is None:
            self.strides = _c_strides(shape, dt.itemsize)
            self._c: bool | None = True
        else:
            self.strides = strides
            self._c = None
        self._offset = offset
        if memory is None:
            memory = _Memory(backend.recorder, math.prod(shape) * dt.itemsize)
        self._mem = memory

    # --- layout ------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def c_contiguous(self) -> bool:
        c = self._c
        if c is None:
            c = self._c = _is_c_contiguous(self.shape, self.strides, self.dtype.itemsize)
        return c

    @property
    def flags(self) -> _Flags:
        return _Flags(self)

    @property
    def aligned16(self) -> bool:
        """Whether the first element sits on a 16-byte boundary (allocations are 512-byte
        aligned), as the CUDA backend's kernels need."""
        return self._offset % 16 == 0

    @property
    def device(self) -> Device:
        return self.nybble_backend.device

    def _view(self, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> RecordArray:
        return RecordArray(self.nybble_backend, shape, self.dtype, self._mem, strides, offset)

    def _new(self, shape: tuple[int, ...], dtype: DTypeLike | None = None) -> RecordArray:
        return RecordArray(self.nybble_backend, shape, self.dtype if dtype is None else dtype)

    def reshape(self, *shape: Any, order: str = "C") -> RecordArray:
        new = _infer(_shape_of(shape), self.size)
        if new == self.shape:
            return self._view(self.shape, self.strides, self._offset)
        if self.c_contiguous:
            return self._view(new, _c_strides(new, self.dtype.itemsize), self._offset)
        strides = _nocopy_strides(self, new)
        if strides is None:
            return self.copy().reshape(new)
        return self._view(new, strides, self._offset)

    def ravel(self) -> RecordArray:
        return self.reshape(-1)

    def transpose(self, *axes: Any) -> RecordArray:
        order = _shape_of(axes) if axes else range(self.ndim - 1, -1, -1)
        shape, strides = self.shape, self.strides
        return self._view(
            tuple([shape[i] for i in order]), tuple([strides[i] for i in order]), self._offset
        )

    @property
    def T(self) -> RecordArray:
        return self.transpose()

    def swapaxes(self, a: int, b: int) -> RecordArray:
        order = list(range(self.ndim))
        order[a], order[b] = order[b], order[a]
        return self.transpose(order)

    def view(self, dtype: DTypeLike | None = None) -> RecordArray:
        if dtype is None or np.dtype(dtype) == self.dtype:
            return self._view(self.shape, self.strides, self._offset)
        dt = np.dtype(dtype)
        if not self.c_contiguous or (self.shape[-1] * self.itemsize) % dt.itemsize:
            raise ValueError("a view in another dtype needs a C-contiguous array")
        shape = (*self.shape[:-1], self.shape[-1] * self.itemsize // dt.itemsize)
        return RecordArray(self.nybble_backend, shape, dt, self._mem, None, self._offset)

    def copy(self, order: str = "C") -> RecordArray:
        return self._new(self.shape)

    def astype(self, dtype: DTypeLike, copy: bool = True, order: str = "K") -> RecordArray:
        dt = np.dtype(dtype)
        if not copy and dt == self.dtype and (order in ("K", "A") or self.c_contiguous):
            return self
        if order in ("C", "A") or self.c_contiguous:
            return self._new(self.shape, dt)
        return RecordArray(self.nybble_backend, self.shape, dt, strides=_k_strides(self))

    def fill(self, value: Any) -> None:
        pass

    def get(self) -> RecordArray:
        """The host copy (CuPy's `get`): an array of the host backend."""
        return self.nybble_backend.to_host(self)

    def item(self) -> float:
        return 0.0

    def tolist(self) -> Any:
        raise TypeError("a recorded array holds no values")

    def __float__(self) -> float:
        return 0.0

    def __int__(self) -> int:
        return 0

    def __bool__(self) -> bool:
        return False

    def __index__(self) -> int:
        return 0

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError(
            "a recorded array holds no values: it cannot become a numpy array (code run on the "
            "recording backend must move arrays through the backend, not numpy)"
        )

    def __repr__(self) -> str:
        where = "host" if self.nybble_backend.recorder is None else "recorded"
        return f"RecordArray({self.shape}, {dtype_name(self.dtype)}, {where})"

    # --- indexing ------------------------------------------------------------------------

    def _index(self, key: Any) -> tuple[RecordArray | None, tuple[int, ...], int]:
        """A basic index as a view (the view, (), 0), or an advanced one as (None, the
        result's shape, the number of index arrays)."""
        if not isinstance(key, tuple):
            key = (key,)
        arrays = 0
        for k in key:
            if isinstance(k, (RecordArray, list)) or (isinstance(k, np.ndarray) and k.ndim):
                if not isinstance(k, list) and np.dtype(_operand(k)).kind == "b":
                    raise TypeError("indexing by a mask: the result's size is in the values")
                arrays += 1
        real = sum(1 for k in key if k is not None and k is not Ellipsis)
        fill = (slice(None),) * (self.ndim - real)
        dots = [i for i, k in enumerate(key) if k is Ellipsis]
        key = key[: dots[0]] + fill + key[dots[0] + 1 :] if dots else key + fill
        if arrays:
            return None, self._advanced_shape(key), arrays
        shape, strides = [], []
        offset = self._offset
        axis = 0
        for k in key:
            if k is None:
                shape.append(1)
                strides.append(0)
                continue
            n, s = self.shape[axis], self.strides[axis]
            axis += 1
            if isinstance(k, slice):
                start, stop, step = k.indices(n)
                count = len(range(start, stop, step))
                offset += start * s if count else 0
                shape.append(count)
                strides.append(s * step)
            else:
                i = int(k)
                if not -n <= i < n:
                    raise IndexError(f"index {i} is out of bounds for an axis of size {n}")
                offset += (i % n) * s
        return self._view(tuple(shape), tuple(strides), offset), (), 0

    def _advanced_shape(self, key: tuple[Any, ...]) -> tuple[int, ...]:
        """numpy's result shape for integer-array indexing (with slices on the other axes)."""
        arrays: list[tuple[int, ...]] = []
        where: list[int] = []
        rest: list[tuple[int, int]] = []
        axis = 0
        for position, k in enumerate(key):
            if k is None:
                rest.append((position, 1))
                continue
            n = self.shape[axis]
            axis += 1
            if isinstance(k, slice):
                rest.append((position, len(range(*k.indices(n)))))
            elif isinstance(k, (int, np.integer)):
                arrays.append(())
                where.append(position)
            else:
                arrays.append(tuple(np.shape(k)) if not isinstance(k, RecordArray) else k.shape)
                where.append(position)
        index_shape = np.broadcast_shapes(*arrays)
        others = [n for _, n in rest]
        if where == list(range(where[0], where[0] + len(where))):  # adjacent: in place
            before = [n for p, n in rest if p < where[0]]
            after = [n for p, n in rest if p > where[-1]]
            return (*before, *index_shape, *after)
        return (*index_shape, *others)

    def _basic(self, key: tuple[Any, ...]) -> RecordArray | None:
        """A view for an index of slices and integers only (the common case), else None."""
        if len(key) > len(self.shape):
            return None
        shape = list(self.shape)
        strides = list(self.strides)
        offset = self._offset
        drop = []
        for axis, k in enumerate(key):
            t = type(k)
            if t is slice:
                if k.start is None and k.stop is None and k.step is None:
                    continue
                n, st = shape[axis], strides[axis]
                start, stop, step = k.indices(n)
                count = len(range(start, stop, step))
                offset += start * st if count else 0
                shape[axis] = count
                strides[axis] = st * step
            elif t is int:
                n = shape[axis]
                if not -n <= k < n:
                    raise IndexError(f"index {k} is out of bounds for an axis of size {n}")
                offset += (k % n) * strides[axis]
                drop.append(axis)
            else:
                return None
        for axis in reversed(drop):
            del shape[axis], strides[axis]
        return self._view(tuple(shape), tuple(strides), offset)

    def __getitem__(self, key: Any) -> RecordArray:
        view = self._basic(key if type(key) is tuple else (key,))
        if view is not None:
            return view
        view, shape, arrays = self._index(key)
        if view is not None:
            return view
        temp = self._new((math.prod(shape),), np.int64) if arrays > 1 else None
        out = self._new(shape)
        del temp  # several index arrays: a flat index of the result's elements first
        return out

    def __setitem__(self, key: Any, value: Any) -> None:
        if type(key) in _BASIC or (
            type(key) is tuple and all(type(k) in _BASIC or k is None for k in key)
        ):
            return  # a copy into a view: no allocation
        view, shape, arrays = self._index(key)
        if view is None and arrays > 1:
            self._new((math.prod(shape),), np.int64)  # the flat index, dropped at once

    # --- arithmetic ----------------------------------------------------------------------

    def _binary(self, other: Any, kind: str = "") -> RecordArray:
        dtype: np.dtype[Any]
        if kind == "compare":
            dtype = np.dtype(np.bool_)
        else:
            dtype = _promote(self.dtype, other)
            if kind == "divide" and dtype.kind in "biu":
                dtype = np.dtype(np.float64)
        other_shape = other.shape if isinstance(other, RecordArray) else np.shape(other)
        shape = np.broadcast_shapes(self.shape, other_shape)
        return RecordArray(self.nybble_backend, tuple(shape), dtype)

    def __add__(self, o: Any) -> RecordArray:
        return self._binary(o)

    __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __add__
    __pow__ = __rpow__ = __mod__ = __floordiv__ = __add__
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __add__
    __lshift__ = __rshift__ = __add__

    def __truediv__(self, o: Any) -> RecordArray:
        return self._binary(o, "divide")

    __rtruediv__ = __truediv__

    def __matmul__(self, o: Any) -> RecordArray:
        shape = (*self.shape[:-1], o.shape[-1])
        return RecordArray(self.nybble_backend, shape, np.result_type(self.dtype, o.dtype))

    def __eq__(self, o: Any) -> RecordArray:  # type: ignore[override]
        return self._binary(o, "compare")

    __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__  # type: ignore[assignment]

    def __neg__(self) -> RecordArray:
        return self._new(self.shape)

    __pos__ = __abs__ = __invert__ = __neg__

    def __iadd__(self, o: Any) -> RecordArray:
        return self

    __isub__ = __imul__ = __itruediv__ = __ipow__ = __iand__ = __ior__ = __ixor__ = __iadd__
    __ilshift__ = __irshift__ = __iadd__

    # --- reductions ----------------------------------------------------------------------

    def _reduce(self, axis: Any, dtype: DTypeLike, keepdims: bool) -> RecordArray:
        axes = _axes(axis, self.ndim)
        if keepdims:
            shape = tuple(1 if i in axes else n for i, n in enumerate(self.shape))
        else:
            shape = tuple(n for i, n in enumerate(self.shape) if i not in axes)
        out = self._new(shape, dtype)
        # its workspace, made and dropped: along axes a few bytes; over the whole array 32
        # bytes per block of the first pass
        if len(axes) < self.ndim:
            self._new((1,), np.uint8)
        elif self.size > _REDUCE_SMALL:
            self._new((32 * -(-self.size // _REDUCE_BLOCK),), np.uint8)
        return out

    def sum(
        self, axis: Any = None, dtype: DTypeLike | None = None, keepdims: bool = False
    ) -> RecordArray:
        if dtype is None:
            kind = self.dtype.kind
            dtype = np.int64 if kind in "bi" else np.uint64 if kind == "u" else self.dtype
        return self._reduce(axis, dtype, keepdims)

    def mean(
        self, axis: Any = None, dtype: DTypeLike | None = None, keepdims: bool = False
    ) -> RecordArray:
        if dtype is None:
            dtype = np.float64 if self.dtype.kind in "biu" else self.dtype
        return self._reduce(axis, dtype, keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> RecordArray:
        return self._reduce(axis, self.dtype, keepdims)

    min = max

    def any(self, axis: Any = None, keepdims: bool = False) -> RecordArray:
        return self._reduce(axis, np.bool_, keepdims)

    all = any

    def argmax(self, axis: Any = None) -> RecordArray:
        return self._reduce(axis, np.int64, False)

    argmin = argmax


class _NoLaunch:
    """A kernel of a recorded run: launching it does nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _KernelModule:
    """A compiled module of kernels/ (backends/cuda/kernels.KernelModule, as the trainer's
    train/_cuda.py asks the backend for its files: `RecordingBackend.kernel_module`) in a
    recorded run: nothing is compiled, its kernels launch nothing, and its launch facts are
    worked out from the source text (kernels.source_facts), with the `-D` definitions of its
    options."""

    def __init__(self, file: str, options: Sequence[str] = ()) -> None:
        self.file = file
        self.defines = tuple(o[2:] for o in options if o.startswith("-D"))

    def function(self, name: str, dynamic_shared: int = 0) -> _NoLaunch:
        return _NoLaunch()

    def read_facts(self, symbol: str, count: int) -> tuple[int, ...]:
        from ..cuda import kernels

        found = kernels.source_facts(kernels.source(self.file), symbol, self.defines)
        if len(found) < count:
            raise ValueError(f"{self.file}: {symbol} has {len(found)} values, not {count}")
        return found[:count]


class Namespace:
    """CuPy's array API, as far as the code that runs on the recording backend uses it, for
    one backend's arrays (`xp`)."""

    float16 = np.float16
    float32 = np.float32
    float64 = np.float64
    int8 = np.int8
    int16 = np.int16
    int32 = np.int32
    int64 = np.int64
    uint8 = np.uint8
    uint16 = np.uint16
    uint32 = np.uint32
    uint64 = np.uint64
    bool_ = np.bool_
    dtype = np.dtype
    ndarray = RecordArray
    inf = np.inf

    def __init__(self, backend: RecordingBackend) -> None:
        self._backend = backend
        #: CuPy's device calls: device 0, current stream 0, nothing to wait for.
        self.cuda = SimpleNamespace(
            runtime=SimpleNamespace(getDevice=lambda: 0),
            get_current_stream=lambda: SimpleNamespace(ptr=0, is_capturing=lambda: False),
        )
        self.linalg = SimpleNamespace(norm=self._norm)

    # --- making arrays -------------------------------------------------------------------

    def _array(self, shape: Any, dtype: DTypeLike = float) -> RecordArray:
        if type(shape) is not tuple or not all(type(n) is int for n in shape):
            shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
            shape = tuple(int(n) for n in shape)
        return RecordArray(self._backend, shape, dtype)

    def empty(self, shape: Any, dtype: DTypeLike = float, order: str = "C") -> RecordArray:
        return self._array(shape, dtype)

    zeros = ones = empty

    def full(self, shape: Any, fill_value: Any, dtype: DTypeLike | None = None) -> RecordArray:
        return self._array(shape, dtype if dtype is not None else np.asarray(fill_value).dtype)

    def empty_like(self, a: Any, dtype: DTypeLike | None = None, order: str = "K") -> RecordArray:
        return self._array(a.shape, a.dtype if dtype is None else dtype)

    zeros_like = ones_like = empty_like

    def full_like(self, a: Any, fill_value: Any, dtype: DTypeLike | None = None) -> RecordArray:
        return self.empty_like(a, dtype)

    def arange(
        self, start: Any, stop: Any = None, step: Any = 1, dtype: DTypeLike | None = None
    ) -> RecordArray:
        if stop is None:
            start, stop = 0, start
        n = max(0, math.ceil((stop - start) / step))
        if dtype is None:
            dtype = np.result_type(start, stop, step)
        return self._array((n,), dtype)

    def asarray(self, a: Any, dtype: DTypeLike | None = None, order: Any = None) -> RecordArray:
        if isinstance(a, RecordArray) and a.nybble_backend is self._backend:
            return a if dtype is None else a.astype(dtype, copy=False)
        return self._backend.from_host(a if dtype is None else self._host(a).astype(dtype))

    def array(
        self, a: Any, dtype: DTypeLike | None = None, copy: bool = True, order: str = "K"
    ) -> RecordArray:
        found = self.asarray(a)
        if not copy and (dtype is None or np.dtype(dtype) == found.dtype):
            return found
        return found.astype(found.dtype if dtype is None else dtype, order=order)

    def ascontiguousarray(self, a: Any, dtype: DTypeLike | None = None) -> RecordArray:
        a = self.asarray(a)
        if a.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        return a.astype(a.dtype if dtype is None else dtype, order="C")

    def _host(self, a: Any) -> RecordArray:
        if isinstance(a, RecordArray):
            return a
        return self._backend.host().from_host(a)

    def concatenate(
        self, arrays: Sequence[RecordArray], axis: int = 0, out: RecordArray | None = None
    ) -> RecordArray:
        first = arrays[0]
        axis %= first.ndim
        shape = list(first.shape)
        shape[axis] = sum(a.shape[axis] for a in arrays)
        dtype = first.dtype
        for a in arrays[1:]:
            dtype = np.promote_types(dtype, a.dtype)
        if out is None:
            out = self._array(tuple(shape), dtype)
        n = len(arrays)
        if n > _CONCAT_MANY and all(a.dtype == out.dtype for a in arrays):
            if sum(a.nbytes for a in arrays) < _CONCAT_SMALL * n:
                # one kernel reads a table of the arrays' addresses and, unless they are all
                # alike and contiguous, tables of their sizes and strides
                ptrs = self._array((n,), np.int64)
                width = shape[axis] // n
                alike = all(a.c_contiguous and a.shape[axis] == width for a in arrays)
                if not alike:
                    sizes = self._array((n,), np.int64)
                    strides = self._array((n, len(shape)), np.int64)
                    del sizes, strides
                del ptrs
        return out

    def where(self, condition: Any, x: Any, y: Any) -> RecordArray:
        dtype = np.result_type(_operand(x), _operand(y))
        shapes = [np.shape(v) if not isinstance(v, RecordArray) else v.shape for v in (x, y)]
        return self._array(np.broadcast_shapes(condition.shape, *shapes), dtype)

    def repeat(self, a: RecordArray, repeats: int, axis: int | None = None) -> RecordArray:
        if axis is None:
            return self._array((a.size * repeats,), a.dtype)
        shape = list(a.shape)
        shape[axis] *= repeats
        return self._array(tuple(shape), a.dtype)

    def unique(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("unique: the result's size is in the values, which a recording lacks")

    # --- elementwise -------------------------------------------------------------------

    def _unary(self, x: RecordArray, out: RecordArray | None = None) -> RecordArray:
        if out is not None:
            return out
        dtype = np.float64 if x.dtype.kind in "biu" else x.dtype
        return self._array(x.shape, dtype)

    exp = log = sqrt = tanh = cos = sin = abs = negative = _unary

    def isfinite(self, x: RecordArray) -> RecordArray:
        return self._array(x.shape, np.bool_)

    isnan = isinf = isfinite

    def maximum(self, x: Any, y: Any) -> RecordArray:
        return x._binary(y) if isinstance(x, RecordArray) else y._binary(x)

    minimum = maximum

    def matmul(self, a: RecordArray, b: RecordArray) -> RecordArray:
        return a @ b

    def _norm(self, x: RecordArray, axis: Any = None) -> RecordArray:
        squared = self._array(x.shape, x.dtype)
        out = squared.sum(axis=axis)
        del squared
        return self.sqrt(out)

    def asnumpy(self, a: RecordArray) -> RecordArray:
        return self._backend.to_host(a)


__all__ = ["Namespace", "RecordArray", "Recorder"]
