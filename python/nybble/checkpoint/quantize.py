"""`quantize_checkpoint`: a dense Hugging Face checkpoint to NF4 / FP4 / int8, in nybble's
layout or in bitsandbytes' 4-bit layout that transformers loads (docs/checkpoints.md)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import formats
from .._checkpoint_io import layouts
from .._checkpoint_io.layouts import Layout, QuantGroup, QuantSpec
from .._checkpoint_io.source import CONFIG_FILE, Checkpoint
from ..errors import FormatError, NonFiniteError
from ..formats import Codebook, OutputDtype
from ..safetensors_io import Entry
from ..tensor import quantize
from ._common import (
    FLOAT_CODES,
    Report,
    Timer,
    compute_backend,
    dtype_name,
    is_float_matrix,
    module_of,
    parse_size,
    select_targets,
)
from ._output import DEFAULT_MAX_SHARD_SIZE, check_apart
from ._pipeline import Progress, Scratch, Task, copy_task, write_checkpoint

#: quantization_config.quant_method of checkpoints this module can read or write.
QUANT_METHODS = {"nybble": "nybble", "bnb": "bitsandbytes"}


def quantize_checkpoint(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    layout: Layout = "nybble",
    codebook: Codebook = "nf4",
    blocksize: int = 64,
    double_quant: bool = False,
    targets: Sequence[str] | None = None,
    compute_dtype: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    device: str = "cpu",
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Report:
    """Quantizes the chosen weights of the checkpoint at `source` (a directory or one
    .safetensors file) into a new checkpoint directory `target`.

    `targets`: patterns naming the weights (see `select_targets`); by default the linear
    projections of the decoder layers. Weights already quantized (either layout) are carried
    over unchanged, converted losslessly to `layout`. `layout="bnb"` writes what transformers
    saves for a 4-bit bitsandbytes model, with its `quantization_config` (`compute_dtype`:
    bnb_4bit_compute_dtype, by default the checkpoint's dtype). Other files (tokenizer, ...)
    are copied. `target` must not exist unless `overwrite`; it appears complete or not at all.
    FormatError for a malformed input, naming the file and the tensor or field."""
    timer = Timer()
    check_apart(target, {"input": source})
    if layout not in layouts.LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(layouts.LAYOUTS)}, got {layout!r}")
    spec = QuantSpec(codebook, blocksize, double_quant).check()
    if layout == "bnb" and codebook not in ("nf4", "fp4"):
        raise ValueError(f"the bitsandbytes layout holds nf4 or fp4, not {codebook}")
    shard_size = parse_size(max_shard_size)
    backend = compute_backend(device)
    with Checkpoint(source) as ckpt:
        groups = layouts.find_groups(ckpt.names(), ckpt.path)
        config = _check_config(ckpt, layout)
        members = {name for g in groups.values() for name in g.members}
        infos = [ckpt.info(n) for n in ckpt.names() if n not in members]
        chosen = select_targets(infos, targets, ckpt.path)
        if layout == "bnb":
            for name in chosen:
                if re.search(r"(^|\.)lm_head\.weight$", name):
                    raise ValueError(
                        f"{name}: transformers keeps lm_head dense when it loads a 4-bit "
                        "checkpoint; leave it out of the targets with the bitsandbytes layout"
                    )
        tasks, done = _plan(ckpt, groups, set(chosen), spec, layout, backend)
        if layout == "bnb" and config is not None:
            config["quantization_config"] = bnb_quantization_config(
                spec, _compute_dtype(compute_dtype, config), _skip_modules(ckpt, groups, chosen)
            )
        elif config is not None:
            config["quantization_config"] = nybble_quantization_config(spec)
        report = Report("quantize", str(ckpt.path), str(target), weights=done)
        write_checkpoint(ckpt, tasks, config, report, target, overwrite, shard_size, progress)
    report.seconds = timer.seconds()
    return report


def _check_config(ckpt: Checkpoint, layout: Layout) -> dict[str, Any] | None:
    config = None if ckpt.config is None else dict(ckpt.config)
    path = ckpt.directory / CONFIG_FILE
    if config is None:
        if layout == "bnb":
            raise FormatError(path, "missing; transformers needs it to load a 4-bit checkpoint")
        return None
    qc = config.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if method not in QUANT_METHODS.values():
            raise FormatError(
                path,
                f"the checkpoint is already quantized ({method!r}); nybble quantizes dense "
                "checkpoints and converts between its own and bitsandbytes' 4-bit layouts",
                "quantization_config",
            )
    return config


def _plan(
    ckpt: Checkpoint,
    groups: dict[str, QuantGroup],
    chosen: set[str],
    spec: QuantSpec,
    layout: Layout,
    backend: Any,
) -> tuple[list[Task], dict[str, list[str]]]:
    tasks: list[Task] = []
    done: dict[str, list[str]] = {"quantized": [], "converted": [], "copied": []}
    group_of = {name: g for g in groups.values() for name in g.members}
    planned: set[str] = set()
    for name in ckpt.names():
        info = ckpt.info(name)
        group = group_of.get(name)
        if group is not None:
            if group.prefix not in planned:
                planned.add(group.prefix)
                tasks.append(_convert_task(ckpt, group, layout))
                done["converted"].append(group.prefix)
        elif name in chosen:
            dtype: OutputDtype = (
                "float32" if info.dtype == "F64" else formats.output_dtype(FLOAT_CODES[info.dtype])
            )
            outputs = layouts.entries(layout, name, info.shape, spec, dtype)
            out_bytes = sum(e.nbytes for e in outputs)
            tasks.append(
                Task(
                    [name],
                    outputs,
                    _quantize_work(ckpt, name, spec, layout, backend),
                    info.nbytes + out_bytes,
                    info.nbytes,
                )
            )
            done["quantized"].append(name)
        else:
            tasks.append(copy_task(name, Entry(name, info.dtype, info.shape)))
            done["copied"].append(name)
    return tasks, done


def _quantize_work(
    ckpt: Checkpoint, name: str, spec: QuantSpec, layout: Layout, backend: Any
) -> Any:
    def work(arrays: Mapping[str, np.ndarray], scratch: Scratch) -> dict[str, np.ndarray]:
        x = backend.from_host(arrays[name])
        try:
            q = quantize(x, spec.blocksize, spec.double_quant, spec.codebook)
        except NonFiniteError as e:
            raise FormatError(
                ckpt.file_of(name), f"non-finite value (NaN or inf) at flat index {e.index}", name
            ) from None
        return layouts.export(q, layout, name)

    return work


def _convert_task(ckpt: Checkpoint, group: QuantGroup, layout: Layout) -> Task:
    """A quantized weight carried over: read, checked, written in `layout` (lossless)."""
    names = list(group.members)
    size = sum(ckpt.info(n).nbytes for n in names)
    header = layouts.read_header(group, ckpt.read, ckpt.file_of)
    spec = QuantSpec(header.codebook, header.blocksize, header.double_quant)
    if layout == "bnb" and spec.codebook not in ("nf4", "fp4"):
        raise FormatError(
            ckpt.file_of(group.state_key),
            f"{spec.codebook} has no bitsandbytes 4-bit layout",
            group.state_key,
        )
    outputs = layouts.entries(layout, group.prefix, header.shape, spec, header.dtype)

    def work(arrays: Mapping[str, np.ndarray], scratch: Scratch) -> dict[str, np.ndarray]:
        q = layouts.load_group(group, arrays.__getitem__, ckpt.file_of)
        return layouts.export(q, layout, group.prefix)

    return Task(names, outputs, work, 2 * size, size)


def nybble_quantization_config(spec: QuantSpec) -> dict[str, Any]:
    return {
        "quant_method": QUANT_METHODS["nybble"],
        "format": layouts.NYBBLE_FORMAT,
        "codebook": spec.codebook,
        "blocksize": spec.blocksize,
        "double_quant": spec.double_quant,
    }


def bnb_quantization_config(
    spec: QuantSpec, compute_dtype: OutputDtype, skip_modules: list[str]
) -> dict[str, Any]:
    """transformers' BitsAndBytesConfig(load_in_4bit=True, ...).to_dict()."""
    return {
        "quant_method": QUANT_METHODS["bnb"],
        "_load_in_4bit": True,
        "_load_in_8bit": False,
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": spec.codebook,
        "bnb_4bit_use_double_quant": spec.double_quant,
        "bnb_4bit_compute_dtype": compute_dtype,
        "bnb_4bit_quant_storage": "uint8",
        "llm_int8_threshold": 6.0,
        "llm_int8_skip_modules": skip_modules,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
    }


def _compute_dtype(value: str | None, config: Mapping[str, Any] | None) -> OutputDtype:
    if value is not None:
        return dtype_name(value, "compute_dtype")
    declared = None if config is None else config.get("dtype", config.get("torch_dtype"))
    try:
        return dtype_name(declared)
    except ValueError:
        return "float32"  # transformers' own default


def _skip_modules(
    ckpt: Checkpoint, groups: Mapping[str, QuantGroup], chosen: Sequence[str]
) -> list[str]:
    """llm_int8_skip_modules: every module with a dense 2-D weight (transformers must not
    make a Linear4bit of it) plus lm_head (which may be tied and absent). transformers reads
    each entry as a prefix regex (and as a suffix): a module path that would also catch a
    quantized module (`mlp.gate` and `mlp.gate_proj`) is written escaped and anchored."""
    quantized = {module_of(n) for n in chosen} | {module_of(g.prefix) for g in groups.values()}
    members = {n for g in groups.values() for n in g.members}
    dense = {
        module_of(n)
        for n in ckpt.names()
        if n not in members and n not in chosen and is_float_matrix(ckpt.info(n))
    }
    out = []
    for module in sorted(dense | {"lm_head"}):
        if module in quantized:
            continue
        catches = any(_catches(module, q) for q in quantized)
        out.append(re.escape(module) + "$" if catches else module)
    return out


def _catches(entry: str, module: str) -> bool:
    """Whether transformers would skip `module` given the skip entry `entry` (v5 reads
    entries as regexes matched at the start, or as suffixes; v4 as prefixes ending at a dot)."""
    try:
        as_regex = re.match(entry, module) is not None
    except re.error:
        as_regex = True
    return as_regex or module.endswith(entry) or module.startswith(entry + ".")
