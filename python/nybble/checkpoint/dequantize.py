"""`dequantize_checkpoint`: a 4-bit checkpoint (nybble's layout, or bitsandbytes' as
transformers saves it) back to dense safetensors (docs/checkpoints.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import backends, formats
from .._checkpoint_io import layouts
from .._checkpoint_io.layouts import QuantGroup
from .._checkpoint_io.source import Checkpoint
from ..errors import FormatError
from ..formats import OutputDtype
from ..safetensors_io import Entry
from ..tensor import NF4Tensor
from ._common import OUTPUT_CODES, Report, Timer, compute_backend, dtype_name
from ._output import DEFAULT_MAX_SHARD_SIZE, check_apart, without_quantization
from ._pipeline import Progress, Scratch, Task, copy_task, write_checkpoint


def dequantize_checkpoint(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    device: str = "cpu",
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Report:
    """Writes the checkpoint at `source` with every quantized weight dequantized, to `dtype`
    (bfloat16, float16, float32; by default the dtype each weight was quantized from), and
    config.json without its quantization config. Other tensors and files are copied as they
    are. FormatError for a malformed input, naming the file and the tensor or field, and
    for a checkpoint without quantized weights (nothing to do: nothing is written)."""
    from ._common import parse_size

    timer = Timer()
    check_apart(target, {"input": source})
    out_dtype = None if dtype is None else dtype_name(dtype)
    shard_size = parse_size(max_shard_size)
    backend = compute_backend(device)
    with Checkpoint(source) as ckpt:
        groups = layouts.find_groups(ckpt.names(), ckpt.path)
        if not groups:  # a copy would look like success and change nothing
            raise FormatError(
                ckpt.path,
                "holds no quantized weight (nybble's or bitsandbytes' 4-bit layout): nothing "
                "to dequantize, nothing written",
            )
        group_of = {name: g for g in groups.values() for name in g.members}
        tasks: list[Task] = []
        done: dict[str, list[str]] = {"dequantized": [], "copied": []}
        for name in ckpt.names():
            group = group_of.get(name)
            if group is None:
                info = ckpt.info(name)
                tasks.append(copy_task(name, Entry(name, info.dtype, info.shape)))
                done["copied"].append(name)
            elif group.state_key == name:
                tasks.append(dequantize_task(ckpt, group, out_dtype, backend))
                done["dequantized"].append(group.prefix)
        report = Report("dequantize", str(ckpt.path), str(target), weights=done)
        config = None if ckpt.config is None else without_quantization(ckpt.config)
        write_checkpoint(ckpt, tasks, config, report, target, overwrite, shard_size, progress)
    report.seconds = timer.seconds()
    return report


def dequantize_task(
    ckpt: Checkpoint, group: QuantGroup, dtype: OutputDtype | None, backend: Any
) -> Task:
    """Reads a quantized weight and writes it dense under its own name."""
    header = layouts.read_header(group, ckpt.read, ckpt.file_of)
    out_dtype = dtype or header.dtype
    entry = Entry(group.prefix, OUTPUT_CODES[out_dtype], header.shape)
    names = list(group.members)
    size = sum(ckpt.info(n).nbytes for n in names)

    def work(arrays: Mapping[str, np.ndarray], scratch: Scratch) -> dict[str, np.ndarray]:
        q = layouts.load_group(group, arrays.__getitem__, ckpt.file_of)
        out = scratch.array(header.shape, formats.numpy_dtype(out_dtype))
        return {group.prefix: dense(q, out_dtype, backend, ckpt, group, out)}

    return Task(names, [entry], work, size + entry.nbytes, size)


def dense(
    q: NF4Tensor,
    dtype: OutputDtype,
    backend: Any,
    ckpt: Checkpoint,
    group: QuantGroup,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The dequantized weight on the host (in `out` when given); FormatError if it does not
    fit `dtype` (float16 overflow), naming the tensor."""
    q = q._moved(backend)  # dequantized where the backend computes, returned on the host
    into = out if out is not None and backends.of(out).device == backend.device else None
    w = backend.to_host(q.dequantize(dtype, out=into))
    if out is not None and w is not out:
        out[...] = w
        w = out
    if dtype == "float16" and not bool(np.isfinite(w).all()):
        raise FormatError(
            ckpt.file_of(group.state_key),
            "does not fit float16 (values beyond 65504); choose bfloat16 or float32",
            group.prefix,
        )
    return np.asarray(w, formats.numpy_dtype(dtype))
