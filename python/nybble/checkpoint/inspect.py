"""`inspect_checkpoint`: what a checkpoint (or one safetensors file) holds — tensors,
dtypes, shapes, formats and sizes, totals per module kind — and, against a dense reference,
the quantization error of each weight (docs/checkpoints.md)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .._checkpoint_io import layouts
from .._checkpoint_io.layouts import QuantGroup
from .._checkpoint_io.source import Checkpoint
from ..errors import FormatError
from ..tensor import NF4Tensor
from ._common import FLOAT_CODES, module_kind

#: Elements compared at a time against a reference (bounds the float64 temporaries).
CHUNK = 1 << 22


@dataclass
class ErrorStats:
    """A weight against its reference: absolute errors, RMSE relative to the reference's
    RMS, the signal-to-noise ratio, and (for a quantized weight) the largest error relative
    to its block's absmax (contract C-NF4-001 keeps it below 0.16 for NF4)."""

    max_abs: float
    mean_abs: float
    rmse: float
    relative_rmse: float | None  # None against an all-zero reference
    snr_db: float | None  # None when the weight equals its reference
    max_block_relative: float | None = None
    reference_rms: float = 0.0


@dataclass
class ErrorTotals:
    """The errors of a group of weights (a format, or all) against the reference, as if
    they were one tensor: largest and mean absolute error, RMSE relative to the reference's
    RMS, SNR (None when equal), largest error relative to a block's absmax (quantized
    weights only); `weights` compared, `not_compared` (absent from the reference, ...)."""

    weights: int = 0
    parameters: int = 0
    max_abs: float = 0.0
    mean_abs: float = 0.0
    relative_rmse: float | None = None
    snr_db: float | None = None
    max_block_relative: float | None = None
    not_compared: int = 0

    @classmethod
    def of(cls, entries: list[TensorEntry]) -> ErrorTotals:
        out = cls()
        abs_sum = sq_sum = ref_sq = 0.0
        for e in entries:
            s = e.error
            if s is None:
                out.not_compared += 1
                continue
            n = e.parameters
            out.weights += 1
            out.parameters += n
            out.max_abs = max(out.max_abs, s.max_abs)
            abs_sum += s.mean_abs * n
            sq_sum += s.rmse**2 * n
            ref_sq += s.reference_rms**2 * n
            if s.max_block_relative is not None:
                out.max_block_relative = max(out.max_block_relative or 0.0, s.max_block_relative)
        if out.parameters:
            out.mean_abs = abs_sum / out.parameters
            out.relative_rmse = math.sqrt(sq_sum / ref_sq) if ref_sq else None
            out.snr_db = 10 * math.log10(ref_sq / sq_sum) if sq_sum and ref_sq else None
        return out


@dataclass
class TensorEntry:
    """One tensor, or one quantized weight with all of its tensors (`tensors`)."""

    name: str
    kind: str
    format: str
    dtype: str
    shape: list[int]
    parameters: int
    nbytes: int
    tensors: int = 1
    error: ErrorStats | None = None
    note: str | None = None


@dataclass
class Totals:
    tensors: int = 0
    parameters: int = 0
    nbytes: int = 0

    def add(self, e: TensorEntry) -> None:
        self.tensors += e.tensors
        self.parameters += e.parameters
        self.nbytes += e.nbytes

    @property
    def bits_per_parameter(self) -> float:
        return 8 * self.nbytes / self.parameters if self.parameters else 0.0


@dataclass
class Inspection:
    path: str
    files: list[str]
    entries: list[TensorEntry] = field(default_factory=list)
    kinds: dict[str, Totals] = field(default_factory=dict)
    formats: dict[str, Totals] = field(default_factory=dict)
    total: Totals = field(default_factory=Totals)
    reference: str | None = None
    #: With a reference: the errors per format, and of all weights.
    errors: dict[str, ErrorTotals] = field(default_factory=dict)
    error_total: ErrorTotals | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("kinds", "formats"):
            for name, t in getattr(self, key).items():
                out[key][name]["bits_per_parameter"] = round(t.bits_per_parameter, 4)
        out["total"]["bits_per_parameter"] = round(self.total.bits_per_parameter, 4)
        return out


def inspect_checkpoint(
    path: str | os.PathLike[str], reference: str | os.PathLike[str] | None = None
) -> Inspection:
    """Reads headers (and, with `reference`, every weight present in both, whose errors are
    summed up per format in `errors` and over all in `error_total`) one tensor at a time.
    FormatError for malformed files, as the other tools."""
    with Checkpoint(path) as ckpt:
        groups = layouts.find_groups(ckpt.names(), ckpt.path)
        group_of = {n: g for g in groups.values() for n in g.members}
        result = Inspection(str(ckpt.path), sorted(str(f.path) for f in ckpt.files.values()))
        for name in ckpt.names():
            group = group_of.get(name)
            if group is None:
                info = ckpt.info(name)
                entry = TensorEntry(
                    name,
                    module_kind(name),
                    "dense",
                    info.dtype,
                    list(info.shape),
                    math.prod(info.shape),
                    info.nbytes,
                )
            elif group.state_key == name:
                entry = _group_entry(ckpt, group)
            else:
                continue
            result.entries.append(entry)
        if reference is not None:
            with Checkpoint(reference) as ref:
                result.reference = str(ref.path)
                for entry in result.entries:
                    _compare(ckpt, groups.get(entry.name), ref, entry)
    for e in result.entries:
        result.kinds.setdefault(e.kind, Totals()).add(e)
        result.formats.setdefault(e.format, Totals()).add(e)
        result.total.add(e)
    if result.reference is not None:
        for name in result.formats:
            result.errors[name] = ErrorTotals.of([e for e in result.entries if e.format == name])
        result.error_total = ErrorTotals.of(result.entries)
    return result


def _group_entry(ckpt: Checkpoint, group: QuantGroup) -> TensorEntry:
    h = layouts.read_header(group, ckpt.read, ckpt.file_of)
    label = f"{h.codebook} bs{h.blocksize}{' dq' if h.double_quant else ''} ({group.layout})"
    return TensorEntry(
        group.prefix,
        module_kind(group.prefix),
        label,
        h.dtype,
        list(h.shape),
        math.prod(h.shape),
        sum(ckpt.info(n).nbytes for n in group.members),
        len(group.members),
    )


def _compare(
    ckpt: Checkpoint, group: QuantGroup | None, ref: Checkpoint, entry: TensorEntry
) -> None:
    if entry.name not in ref:
        entry.note = "not in the reference"
        return
    info = ref.info(entry.name)
    if info.dtype not in FLOAT_CODES:
        entry.note = f"reference is {info.dtype}"
        return
    if list(info.shape) != entry.shape:
        entry.note = f"reference has shape {list(info.shape)}"
        return
    if group is None:
        if ckpt.info(entry.name).dtype not in FLOAT_CODES:
            entry.note = "not a float tensor"
            return
        values: NF4Tensor | np.ndarray = ckpt.read(entry.name)
    else:
        values = layouts.load_group(group, ckpt.read, ckpt.file_of)
    entry.error = error_stats(ref.read(entry.name), values, ref, entry.name)
    if entry.error is None:
        entry.note = "holds non-finite values"


def error_stats(
    reference: np.ndarray, values: NF4Tensor | np.ndarray, ref: Checkpoint, name: str
) -> ErrorStats | None:
    """Error statistics of `values` (dense, or quantized: dequantized a chunk at a time)
    against `reference`, in float64; None when `values` holds NaN or inf."""
    n = reference.size
    blocksize = values.blocksize if isinstance(values, NF4Tensor) else None
    flat_ref = reference.reshape(-1)
    abs_sum = sq_sum = ref_sq = 0.0
    max_abs = 0.0
    max_block = 0.0
    for start, stop, deq in _chunks(values, n):
        x = flat_ref[start:stop].astype(np.float64)
        if not bool(np.isfinite(x).all()):
            raise FormatError(ref.file_of(name), "non-finite values in the reference", name)
        if not bool(np.isfinite(deq).all()):
            return None
        d = np.abs(deq.astype(np.float64) - x)
        abs_sum += float(d.sum())
        sq_sum += float(np.square(d).sum())
        ref_sq += float(np.square(x).sum())
        max_abs = max(max_abs, float(d.max(initial=0.0)))
        if blocksize is not None:
            pad = -x.size % blocksize
            ax = np.pad(np.abs(x), (0, pad)).reshape(-1, blocksize).max(axis=1)
            db = np.pad(d, (0, pad)).reshape(-1, blocksize).max(axis=1)
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.where(ax > 0, db / ax, 0.0)
            max_block = max(max_block, float(rel.max(initial=0.0)))
    rmse = math.sqrt(sq_sum / n) if n else 0.0
    rms = math.sqrt(ref_sq / n) if n else 0.0
    return ErrorStats(
        max_abs=max_abs,
        mean_abs=abs_sum / n if n else 0.0,
        rmse=rmse,
        relative_rmse=rmse / rms if rms else None,
        snr_db=20 * math.log10(rms / rmse) if rmse and rms else None,
        max_block_relative=max_block if blocksize is not None else None,
        reference_rms=rms,
    )


def _chunks(values: NF4Tensor | np.ndarray, n: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """(start, stop, values[start:stop] as float32) over the flat tensor; a quantized one is
    dequantized a run of whole blocks at a time."""
    if not isinstance(values, NF4Tensor):
        flat = values.reshape(-1)
        for start in range(0, n, CHUNK):
            yield start, min(n, start + CHUNK), flat[start : start + CHUNK].astype(np.float32)
        return
    q = values
    plain = layouts.plain(q)
    step = max(q.blocksize, CHUNK - CHUNK % q.blocksize)
    for start in range(0, n, step):
        stop = min(n, start + step)
        part = layouts.element_range(plain, start, stop, (stop - start,))
        yield start, stop, part.dequantize("float32")
