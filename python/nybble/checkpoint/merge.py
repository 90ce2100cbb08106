"""`merge_adapter`: a PEFT LoRA adapter (LoRA, rsLoRA, DoRA, rank/alpha patterns) merged
into a dense or 4-bit base checkpoint, written dense — what PEFT's `merge_and_unload` gives,
one weight at a time (docs/checkpoints.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import formats, safetensors_io
from .._checkpoint_io import layouts
from .._checkpoint_io.layouts import QuantGroup
from .._checkpoint_io.source import CONFIG_FILE, Checkpoint
from ..errors import FormatError, NonFiniteError
from ..formats import BFLOAT16, OutputDtype
from ..lora.adapter import (
    KEY_PREFIX,
    TOKENS_SUFFIX,
    TokenIndices,
    extra_tensor_kind,
    read_adapter,
    token_rows,
)
from ..lora.config import LoraConfig
from ..lora.layers import LoraLinear, QLoraLinear
from ..safetensors_io import Entry
from ..tensor import NF4Tensor
from ._common import (
    FLOAT_CODES,
    OUTPUT_CODES,
    Report,
    Timer,
    compute_backend,
    dtype_name,
    first,
    module_kind,
    parse_size,
)
from ._output import DEFAULT_MAX_SHARD_SIZE, check_apart, without_quantization
from ._pipeline import Progress, Scratch, Task, copy_task, write_checkpoint
from .dequantize import dense, dequantize_task

#: Rows of a weight merged at a time: about this many bytes of float32 per tile.
TILE_BYTES = 32 * 2**20


@dataclass(frozen=True)
class Adapter:
    """A PEFT adapter read from its directory: the config, each module's tensors, and the
    tensors saved beside LoRA's (LoraAdapter.extra_tensors) with the token ids they need."""

    config: LoraConfig
    weights_path: Path
    modules: dict[str, dict[str, np.ndarray]]
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    modules_to_save: list[str] | None = None
    token_indices: TokenIndices | None = None

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> Adapter:
        f = read_adapter(directory)
        return cls(
            f.config,
            f.weights_path,
            f.modules,
            f.extras,
            f.modules_to_save,
            f.trainable_token_indices,
        )

    def key(self, module: str, part: str = "lora_A.weight") -> str:
        return f"{KEY_PREFIX}{module}.{part}"


def merge_adapter(
    base: str | os.PathLike[str],
    adapter: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    device: str = "cpu",
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Report:
    """Writes `base` with the adapter in `adapter` (adapter_config.json and
    adapter_model.safetensors as PEFT saves them) merged into its weights: W + s·B·A, or
    DoRA's m·(W + s·B·A)/‖W + s·B·A‖. A 4-bit base is dequantized (all of it: the output is
    dense); `dtype` is that of every merged or dequantized weight (by default the base
    weight's). As PEFT's merge_and_unload: a `modules_to_save` copy (or a resized
    vocabulary's embedding) saved with the adapter takes the place of the base's tensor, and
    trainable tokens' rows replace those rows of the embedding. An adapter module with no
    weight in the base, or of another shape, is a FormatError naming it; so is what cannot be
    merged exactly (see `_extras`)."""
    timer = Timer()
    check_apart(target, {"base": base, "adapter": adapter})
    out_dtype = None if dtype is None else dtype_name(dtype)
    shard_size = parse_size(max_shard_size)
    backend = compute_backend(device)
    lora = Adapter.read(adapter)
    with Checkpoint(base) as ckpt:
        groups = layouts.find_groups(ckpt.names(), ckpt.path)
        group_of = {name: g for g in groups.values() for name in g.members}
        missing = [
            m for m in lora.modules if f"{m}.weight" not in ckpt and f"{m}.weight" not in groups
        ]
        if missing:
            raise FormatError(
                lora.weights_path,
                f"{len(missing)} adapter module(s) match no weight in {ckpt.path}: "
                f"{first(missing)} (looked for <module>.weight)",
                lora.key(missing[0]),
            )
        extras = _extras(lora, ckpt, groups)
        tasks: list[Task] = []
        done: dict[str, list[str]] = {"merged": [], "replaced": [], "dequantized": [], "copied": []}
        for name in ckpt.names():
            group = group_of.get(name)
            module = name.removesuffix(".weight") if name.endswith(".weight") else None
            extra = extras.get(group.prefix if group is not None else name)
            if extra is not None:
                if group is None or group.state_key == name:
                    tasks.append(
                        _extra_task(ckpt, group, extra[2], lora, extra, out_dtype, backend)
                    )
                    done["merged" if extra[1] is not None else "replaced"].append(extra[2])
                continue
            if group is not None:
                if group.state_key != name:
                    continue
                module = group.prefix.removesuffix(".weight")
                if module in lora.modules:
                    tasks.append(_merge_group_task(ckpt, group, lora, module, out_dtype, backend))
                    done["merged"].append(group.prefix)
                else:
                    tasks.append(dequantize_task(ckpt, group, out_dtype, backend))
                    done["dequantized"].append(group.prefix)
            elif module is not None and module in lora.modules:
                tasks.append(_merge_dense_task(ckpt, name, lora, module, out_dtype, backend))
                done["merged"].append(name)
            else:
                info = ckpt.info(name)
                tasks.append(copy_task(name, Entry(name, info.dtype, info.shape)))
                done["copied"].append(name)
        report = Report("merge", str(ckpt.path), str(target), weights=done)
        config = None if ckpt.config is None else without_quantization(ckpt.config)
        write_checkpoint(ckpt, tasks, config, report, target, overwrite, shard_size, progress)
    report.seconds = timer.seconds()
    return report


#: An extra tensor as merged: its key in the adapter, the token ids whose rows it holds (None:
#: it replaces the whole tensor), and the base tensor's name.
Extra = tuple[str, "list[int] | None", str]


def _extras(lora: Adapter, ckpt: Checkpoint, groups: Mapping[str, QuantGroup]) -> dict[str, Extra]:
    """The base tensors the adapter's extra tensors go into, by name, checked: the tensor is
    in the base (dense or quantized), no LoRA module and no other extra tensor goes into it,
    and the model does not tie lm_head to the input embeddings where PEFT would untie them
    (a trained lm_head or embedding), or where a stored lm_head would keep the old rows of
    trainable tokens. FormatError naming the adapter's key otherwise."""
    config = ckpt.config or {}
    tied = config.get("tie_word_embeddings") is True
    out: dict[str, Extra] = {}
    for key in sorted(lora.extras):
        kind = extra_tensor_kind(key, lora.modules_to_save, lora.token_indices)
        rest = key[len(KEY_PREFIX) :]
        rows = token_rows(key, lora.token_indices) if kind == "trainable_tokens" else None
        name = rest.removesuffix(TOKENS_SUFFIX) + ".weight" if rows is not None else rest
        if name not in ckpt and name not in groups:
            raise FormatError(
                lora.weights_path,
                f"goes into {name} ({kind}), which {ckpt.path} does not hold",
                key,
            )
        module = name.removesuffix(".weight")
        if (name.endswith(".weight") and module in lora.modules) or name in out:
            raise FormatError(
                lora.weights_path,
                f"goes into {name}, which the adapter also changes otherwise (LoRA, or "
                "another saved tensor): there is no one merged value for it",
                key,
            )
        if tied and rows is None and module_kind(name) in ("lm_head", "embedding"):
            raise FormatError(
                ckpt.directory / CONFIG_FILE,
                f"ties lm_head to the input embeddings, and the adapter replaces {name} "
                f"({key}): PEFT's merge unties them, which nybble merge does not do; merge "
                "with PEFT, or untie the base first",
                "tie_word_embeddings",
            )
        if tied and rows is not None and "lm_head.weight" in ckpt:
            raise FormatError(
                ckpt.directory / CONFIG_FILE,
                "ties lm_head to the input embeddings but the checkpoint also stores "
                f"lm_head.weight: nybble merge cannot tell which the trainable tokens of {key} "
                "go into",
                "tie_word_embeddings",
            )
        out[name] = (key, rows, name)
    return out


def _extra_task(
    ckpt: Checkpoint,
    group: QuantGroup | None,
    name: str,
    lora: Adapter,
    extra: Extra,
    dtype: OutputDtype | None,
    backend: Any,
) -> Task:
    """A base tensor (dense, or a quantized group: written dense) replaced by the adapter's
    tensor, or with its trainable tokens' rows replaced. The value is cast to the output
    dtype (`dtype`, or the base's) as torch's copy into the base's parameter rounds it."""
    key, rows, _ = extra
    value = lora.extras[key]
    if group is not None:
        header = layouts.read_header(group, ckpt.read, ckpt.file_of)
        shape, code = header.shape, OUTPUT_CODES[header.dtype]
    else:
        info = ckpt.info(name)
        shape, code = info.shape, info.dtype
    if dtype is not None and (code in FLOAT_CODES or group is not None):
        code = OUTPUT_CODES[dtype]
    out_np = np.dtype(safetensors_io.DTYPES[code].numpy)
    floats = code in FLOAT_CODES and (value.dtype.kind == "f" or value.dtype == BFLOAT16)
    if not floats and value.dtype != out_np:
        raise FormatError(
            lora.weights_path,
            f"is {value.dtype}, the base's {name} {code}: nybble merge converts floats only",
            key,
        )
    entry = Entry(name, code, shape)
    if rows is None:
        if tuple(value.shape) != tuple(shape):
            raise FormatError(
                lora.weights_path,
                f"shape {list(value.shape)} does not fit the base's {name} {list(shape)} (a "
                "resized vocabulary? nybble merge keeps the base's shapes)",
                key,
            )
        return Task([], [entry], lambda arrays, _: {name: value.astype(out_np)}, entry.nbytes, 0)
    if len(shape) != 2 or tuple(value.shape) != (len(rows), shape[1]) or not floats:
        raise FormatError(
            lora.weights_path,
            f"{value.dtype} {list(value.shape)} does not fit the base's {name} {list(shape)} "
            f"as the rows of {len(rows)} tokens",
            key,
        )
    if len(set(rows)) != len(rows) or max(rows, default=0) >= shape[0]:
        raise FormatError(
            lora.weights_path,
            f"token ids {rows} must be distinct and below the base's {shape[0]} rows of {name}",
            key,
        )
    names = list(group.members) if group is not None else [name]
    size = sum(ckpt.info(n).nbytes for n in names)

    def work(arrays: Mapping[str, np.ndarray], scratch: Scratch) -> dict[str, np.ndarray]:
        if group is not None:
            q = layouts.load_group(group, arrays.__getitem__, ckpt.file_of)
            base = dense(q, formats.output_dtype(out_np), backend, ckpt, group)
        else:
            base = arrays[name]
        out = scratch.array(tuple(shape), out_np)
        out[...] = base
        out[rows] = value.astype(out_np)  # torch's index_copy after casting, as PEFT merges
        if not bool(np.isfinite(out[rows]).all()):
            raise FormatError(
                lora.weights_path, "non-finite rows (NaN, inf, or beyond the dtype)", key
            )
        return {name: out}

    return Task(names, [entry], work, size + 2 * entry.nbytes, size)


def _merge_dense_task(
    ckpt: Checkpoint,
    name: str,
    lora: Adapter,
    module: str,
    dtype: OutputDtype | None,
    backend: Any,
) -> Task:
    info = ckpt.info(name)
    if info.dtype not in FLOAT_CODES or len(info.shape) != 2:
        raise FormatError(
            ckpt.file_of(name),
            f"the adapter has a layer here, but the weight is {info.dtype} {list(info.shape)}, "
            "not a 2-D float matrix",
            name,
        )
    out_dtype = dtype or (
        "float32" if info.dtype == "F64" else formats.output_dtype(FLOAT_CODES[info.dtype])
    )
    cfg = lora.config.for_module(module)
    _check_shapes(lora, module, cfg, info.shape)
    entry = Entry(name, OUTPUT_CODES[out_dtype], info.shape)
    where = (ckpt.file_of(name), name)

    def work(arrays: Mapping[str, np.ndarray], scratch: Scratch) -> dict[str, np.ndarray]:
        result = scratch.array(info.shape, formats.numpy_dtype(out_dtype))
        return {name: _merged(arrays[name], lora, module, cfg, backend, where, result)}

    return Task([name], [entry], work, info.nbytes + entry.nbytes + 4 * TILE_BYTES, info.nbytes)


def _merge_group_task(
    ckpt: Checkpoint,
    group: QuantGroup,
    lora: Adapter,
    module: str,
    dtype: OutputDtype | None,
    backend: Any,
) -> Task:
    header = layouts.read_header(group, ckpt.read, ckpt.file_of)
    if len(header.shape) != 2:
        raise FormatError(
            ckpt.file_of(group.state_key),
            f"a {len(header.shape)}-D weight cannot take LoRA",
            group.prefix,
        )
    out_dtype = dtype or header.dtype
    cfg = lora.config.for_module(module)
    _check_shapes(lora, module, cfg, header.shape)
    entry = Entry(group.prefix, OUTPUT_CODES[out_dtype], header.shape)
    where = (ckpt.file_of(group.state_key), group.prefix)
    names = list(group.members)
    size = sum(ckpt.info(n).nbytes for n in names)

    def work(arrays: Mapping[str, np.ndarray], scratch: Scratch) -> dict[str, np.ndarray]:
        q = layouts.load_group(group, arrays.__getitem__, ckpt.file_of)
        result = scratch.array(header.shape, formats.numpy_dtype(out_dtype))
        return {group.prefix: _merged(q, lora, module, cfg, backend, where, result)}

    return Task(names, [entry], work, size + entry.nbytes + 4 * TILE_BYTES, size)


def _check_shapes(lora: Adapter, module: str, cfg: LoraConfig, stored: tuple[int, ...]) -> None:
    """The adapter's tensors against the base weight ([out, in], or [in, out] with
    fan_in_fan_out)."""
    out_f, in_f = (stored[1], stored[0]) if cfg.fan_in_fan_out else stored
    parts = lora.modules[module]
    want = {
        "lora_A.weight": (cfg.r, in_f),
        "lora_B.weight": (out_f, cfg.r),
        "lora_magnitude_vector": (out_f,),
    }
    for part, array in parts.items():
        if array.shape != want[part]:
            raise FormatError(
                lora.weights_path,
                f"shape {list(array.shape)} does not fit the base weight {list(stored)} "
                f"(expected {list(want[part])})",
                lora.key(module, part),
            )
    if cfg.r > min(in_f, out_f):
        raise FormatError(
            lora.weights_path,
            f"rank {cfg.r} exceeds the base weight's smaller side {min(in_f, out_f)}",
            lora.key(module),
        )


def _merged(
    weight: np.ndarray | NF4Tensor,
    lora: Adapter,
    module: str,
    cfg: LoraConfig,
    backend: Any,
    base: tuple[Path, str],
    result: np.ndarray,
) -> np.ndarray:
    """The merged weight, in the base's stored layout, into `result` (whose dtype is the
    output's), computed a tile of rows at a time by the library's LoRA layers (so the
    float32 temporaries stay small). `base` names the base weight's file and tensor for
    errors."""
    dtype = formats.output_dtype(result.dtype)
    parts = lora.modules[module]
    stored = tuple(weight.shape)
    out_f, in_f = (stored[1], stored[0]) if cfg.fan_in_fan_out else stored
    if isinstance(weight, NF4Tensor):
        # Tiles of rows need rows that start on block boundaries; otherwise all at once.
        weight = layouts.plain(weight) if in_f % weight.blocksize == 0 else weight.dequantize()
    rows = max(cfg.r, TILE_BYTES // (4 * max(in_f, 1)))
    starts = list(range(0, out_f, rows))
    if len(starts) > 1 and out_f - starts[-1] < cfg.r:
        starts.pop()  # a last tile shorter than r joins the one before
    for r0, r1 in zip(starts, [*starts[1:], out_f], strict=True):
        try:
            layer = _tile_layer(weight, r0, r1, in_f, cfg, backend)
        except NonFiniteError as e:
            raise FormatError(
                base[0], f"non-finite value in rows {r0}..{r1 - 1} ({e})", base[1]
            ) from None
        part = "lora_A.weight"
        try:
            layer.set_lora_a(parts[part])
            part = "lora_B.weight"
            layer.set_lora_b(parts[part][r0:r1])
            if cfg.use_dora:
                part = "lora_magnitude_vector"
                layer.set_lora_magnitude(parts[part][r0:r1])
        except NonFiniteError as e:
            raise FormatError(lora.weights_path, str(e), lora.key(module, part)) from None
        tile = backend.to_host(layer.merged_weight(dtype))
        if not bool(np.isfinite(tile).all()):
            raise FormatError(
                lora.weights_path,
                f"merging gives non-finite values (beyond {dtype}) in rows {r0}..{r1 - 1}",
                lora.key(module),
            )
        if cfg.fan_in_fan_out:
            result[:, r0:r1] = tile
        else:
            result[r0:r1] = tile
    return result


def _tile_layer(
    weight: np.ndarray | NF4Tensor, r0: int, r1: int, in_f: int, cfg: LoraConfig, backend: Any
) -> LoraLinear | QLoraLinear:
    if isinstance(weight, NF4Tensor):
        q = layouts.element_range(weight, r0 * in_f, r1 * in_f, (r1 - r0, in_f))
        return QLoraLinear(q._moved(backend), cfg)
    w = weight[:, r0:r1] if cfg.fan_in_fan_out else weight[r0:r1]
    return LoraLinear(backend.from_host(np.ascontiguousarray(w)), cfg)
