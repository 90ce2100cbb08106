"""nybble's NF4 layers on torch.distributed: sharded QLoRA with FSDP2 (`fully_shard`), data
parallel with DDP, per-rank loading, and the adapter saved on rank 0 (docs/multi-gpu.md).

- `shard_model(model, mesh)`: FSDP2 over a model with nybble `Linear4bit` layers (and PEFT's
  LoRA on them): each layer's weight becomes an `NF4Weight` (codes and scales in one tensor),
  which `fully_shard` shards by rows and all-gathers as packed 4-bit data; each decoder layer
  and the root are sharded, with FSDP's `MixedPrecisionPolicy` (for the LoRA parameters; the
  4-bit weights are never cast) and `CPUOffloadPolicy`.
- `data_parallel(model)`: DDP for a model that fits one GPU: the LoRA gradients are
  all-reduced; the 4-bit weights and their scales are left out of DDP's broadcasts (every
  rank loaded the same ones).
- `load_sharded(path, mesh)`: a checkpoint loaded for FSDP2 without any rank holding the
  whole model: parameters are created on the meta device, each rank reads and quantizes only
  the rows of each linear weight that its shard holds (the codes are those of quantizing the
  whole weight, bit for bit), or of a checkpoint stored 4-bit (bitsandbytes' entries) reads
  only those rows' codes and scales; the unquantized parameters (embeddings, norms, head) are
  read whole, one at a time.
- `save_adapter(model, directory)`: the LoRA adapter gathered from the shards and written by
  rank 0 as PEFT's files (adapter_config.json, adapter_model.safetensors), each file
  complete or absent (a new directory appears whole).
- `set_quant_storage(model, dtype)`: the packed codes stored as a float dtype, for FSDP1 and
  DeepSpeed ZeRO-3 (bitsandbytes' `bnb_4bit_quant_storage`), with dtype checks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .. import bnb
from .._files import (
    finish_temporary,
    fsync_directory,
    new_file_mode,
    remove_stale_temporaries,
    temporary_directory,
)
from ..errors import FormatError
from ..formats import NESTED_BLOCKSIZE
from ..safetensors_io import DTYPES
from ._packed import Layout, NF4Weight
from .linear import QUANT_STORAGE_DTYPES, Linear4bit, _backend_double_quantize

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _require_distributed() -> None:
    if not dist.is_available():
        raise ImportError("this torch build has no torch.distributed")
    if not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialized: launch with torchrun and call "
            "torch.distributed.init_process_group() first"
        )


def default_mesh() -> Any:
    """A 1-D device mesh over every rank: CUDA where there is a GPU (one per rank: the
    current device), else the CPU (gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    _require_distributed()
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(kind, (dist.get_world_size(),))


def _linear4bits(model: nn.Module) -> list[tuple[str, Linear4bit]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Linear4bit)]


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper."""
    inner = getattr(model, "module", None)
    if isinstance(model, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module):
        return inner
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model (the classes its `_no_split_modules`
    names, e.g. LlamaDecoderLayer), outermost first."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(
    model: nn.Module,
    mesh: Any = None,
    *,
    mp_policy: Any = None,
    offload: bool = False,
    pin_memory: bool = True,
    reshard_after_forward: bool = True,
    layers: Iterable[nn.Module] | Callable[[nn.Module], bool] | None = None,
    embedding_units: bool = False,
) -> nn.Module:
    """FSDP2 over `model` (a transformers model, with or without PEFT's LoRA): every nybble
    `Linear4bit` is packed into an `NF4Weight` (sharded by rows, gathered as 4-bit data), then
    `fully_shard` is applied to each decoder layer (`layers`: modules, or a predicate; default
    `decoder_layers(model)`) and to the root. Returns `model` (sharded in place).

    mesh         a 1-D DeviceMesh (default: every rank, `default_mesh()`)
    mp_policy    FSDP's `MixedPrecisionPolicy`, e.g. `MixedPrecisionPolicy(param_dtype=
                 torch.bfloat16, reduce_dtype=torch.float32)`: the LoRA (and other float)
                 parameters are gathered and computed in `param_dtype`; the 4-bit weights are
                 not cast (they are codes)
    offload      FSDP's `CPUOffloadPolicy`: the shards (4-bit included), gradients and the
                 optimizer step live in host memory (`pin_memory` as FSDP's)
    embedding_units  the input and output embeddings (the embedding table and the head) as
                 units of their own too, gathered only around their own forward and backward
                 instead of with the root from the first layer to the loss: less memory
                 (measured on the Llama-3.1-70B shape: 28% less reserved at one GPU, 25% at
                 two), a slightly slower step (2-10%); refused for tied embeddings, which
                 two units cannot share (docs/multi-gpu.md)

    Each layer's out_features must divide evenly over the mesh (FSDP pads uneven shards,
    which a packed weight cannot be): a ValueError naming the layer otherwise, raised before
    any collective.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _require_distributed()
    ends = _embedding_modules(model) if embedding_units else ()
    mesh = mesh if mesh is not None else default_mesh()
    if mesh.ndim != 1:
        raise ValueError(f"shard_model takes a 1-D device mesh, got {mesh.ndim} dimensions")
    world = mesh.size()
    rank = mesh.get_local_rank()
    for name, layer in _linear4bits(model):
        if layer.out_features % world:
            raise ValueError(
                f"{name}: {layer.out_features} output rows do not split evenly over {world} "
                "ranks; FSDP pads uneven shards, which a packed 4-bit weight cannot be "
                "(leave the layer unquantized with NybbleConfig(skip_modules=[...]))"
            )
        w = layer.weight
        if isinstance(w, NF4Weight) and not w.is_whole():
            per = layer.out_features // world
            if w.rows_held != (rank * per, (rank + 1) * per):
                raise ValueError(
                    f"{name}: this rank holds rows {list(w.rows_held)} of its weight, loaded "
                    f"for another mesh (rank {rank} of {world} shards rows "
                    f"[{rank * per}, {(rank + 1) * per}))"
                )
        layer.pack_()
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    kwargs["mp_policy"] = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    if layers is None:
        blocks = decoder_layers(model)
    elif callable(layers):
        blocks = [m for m in model.modules() if layers(m)]
    else:
        blocks = list(layers)
    if ends:  # first and last, once (`layers` may name them too)
        blocks = [ends[0], *(b for b in blocks if b is not ends[0] and b is not ends[1]), ends[1]]
    with _integer_parameters_frozen_by_default():
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return model


def _embedding_modules(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The model's input and output embeddings, which must hold no parameter in common."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    first = get_in() if callable(get_in) else None
    last = get_out() if callable(get_out) else None
    if not isinstance(first, nn.Module) or not isinstance(last, nn.Module):
        raise ValueError(
            "embedding_units=True needs a model with input and output embeddings "
            f"(get_input_embeddings / get_output_embeddings); {type(model).__name__} has "
            f"{'none' if first is None and last is None else 'one of them only'}"
        )
    shared = {id(p) for p in first.parameters()} & {id(p) for p in last.parameters()}
    if shared:
        raise ValueError(
            "embedding_units=True: the input and output embeddings share their weight "
            "(tie_word_embeddings), which two FSDP units cannot; leave them with the root"
        )
    return first, last


_OMITTED: Any = object()


@contextlib.contextmanager
def _integer_parameters_frozen_by_default() -> Iterator[None]:
    """`nn.Parameter(data)` with `requires_grad` left out gives a frozen parameter where
    `data` is not floating point (an `NF4Weight`'s uint8 codes, or the DTensor of its shard),
    instead of raising "only Tensors of floating point dtype can require gradients".

    FSDP2 wraps each parameter it manages with `nn.Parameter(...)`: torch 2.11's `fully_shard`
    builds the sharded parameter as `nn.Parameter(dtensor)` (default requires_grad=True,
    which torch refuses for uint8) and only then sets `requires_grad_(param.requires_grad)`
    (2.15 passes `requires_grad=` to the constructor); both move a tensor-subclass parameter
    that is not on the mesh's device (a model loaded on the host, sharded over GPUs) with
    `nn.Parameter(t.to(device))`, no requires_grad. A uint8 parameter can only be frozen, so
    the parameter built here is the one torch 2.15's sharding builds; a floating point `data`,
    or an explicit `requires_grad`, goes to torch's constructor unchanged (an explicit True on
    uint8 still raises). Active for the `fully_shard` calls of `shard_model` only, which run
    in the caller's thread."""
    cls = nn.Parameter
    original = cls.__dict__["__new__"]
    construct = original.__func__ if isinstance(original, staticmethod) else original

    def new(cls: Any, data: Any = None, requires_grad: Any = _OMITTED) -> Any:
        if requires_grad is _OMITTED:
            requires_grad = not (
                isinstance(data, torch.Tensor)
                and not data.is_floating_point()
                and not data.is_complex()
            )
        return construct(cls, data, requires_grad)

    cls.__new__ = staticmethod(new)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        cls.__new__ = original  # type: ignore[method-assign]


def data_parallel(model: nn.Module, **ddp_kwargs: Any) -> nn.parallel.DistributedDataParallel:
    """DDP over `model` (every rank holds the whole 4-bit model: it fits one GPU). The 4-bit
    weights and their scales are left out of DDP's broadcasts (each rank loaded the same
    ones; DDP would otherwise send every layer's scales at each forward), so only the LoRA
    gradients travel, all-reduced. `ddp_kwargs` go to DistributedDataParallel (e.g.
    `device_ids=[local_rank]` on GPUs)."""
    _require_distributed()
    ignore = []
    for name, layer in _linear4bits(model):
        prefix = f"{name}." if name else ""
        for attr in ("weight", "absmax", "absmax2"):
            if getattr(layer, attr, None) is not None:
                ignore.append(prefix + attr)
    ddp: Any = nn.parallel.DistributedDataParallel
    ddp._set_params_and_buffers_to_ignore_for_model(model, ignore)
    return nn.parallel.DistributedDataParallel(model, **ddp_kwargs)


def set_quant_storage(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Stores every `Linear4bit`'s packed codes as `dtype` (its bytes viewed as that dtype;
    bitsandbytes' `bnb_4bit_quant_storage`), so that engines flattening a unit's parameters
    into one dtype (FSDP1's FlatParameter, DeepSpeed ZeRO-3) can shard them with the float
    parameters. Use the dtype the engine keeps parameters in (and computes in: FSDP1's
    MixedPrecision param_dtype, DeepSpeed's bf16/fp16). Module casts (`model.to(dtype)`) move
    the bytes without converting them; a weight an engine did cast is a StorageDtypeError at
    its next forward, never a product of garbage. Returns `model`."""
    if dtype not in QUANT_STORAGE_DTYPES:
        names = "/".join(str(d).removeprefix("torch.") for d in QUANT_STORAGE_DTYPES)
        raise ValueError(f"quant_storage must be one of {names}, got {dtype}")
    for _, layer in _linear4bits(model):
        layer.set_quant_storage(dtype)
    return model


# --- loading for sharded runs -------------------------------------------------------------------


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside create their parameters on the meta device (no memory) and their
    buffers as usual (computed ones such as rotary frequencies stay right)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = {"requires_grad": param.requires_grad}
            meta = param.to("meta")
            module._parameters[name] = type(param)(meta, **kwargs)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


class _Checkpoint:
    """A safetensors checkpoint (one file, or shards with model.safetensors.index.json),
    read a tensor or a range of rows at a time through the safetensors library (memory-mapped:
    rows read are the rows touched)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from .. import _json

        root = Path(path)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _json.read_file(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no weight_map")
            self.files = {str(k): root / str(v) for k, v in weight_map.items()}
        elif (root / "model.safetensors").is_file():
            from safetensors import safe_open

            single = root / "model.safetensors"
            with safe_open(single, framework="pt") as f:
                self.files = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(f"{root}: no model.safetensors or model.safetensors.index.json")
        self._open: dict[Path, Any] = {}
        self._grouped: dict[str, list[str]] | None = None
        self.root = root

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def _file(self, key: str) -> Any:
        from safetensors import safe_open

        if key not in self.files:
            raise KeyError(f"{self.root}: the checkpoint has no tensor {key!r}")
        path = self.files[key]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def rows(self, key: str, a: int, b: int) -> torch.Tensor:
        return self._file(key).get_slice(key)[a:b]

    def shape(self, key: str) -> list[int]:
        return list(self._file(key).get_slice(key).get_shape())

    def tensor(self, key: str) -> torch.Tensor:
        return self._file(key).get_tensor(key)

    def entries(self, prefix: str) -> list[str]:
        """The tensors named `prefix` or `prefix.*` (one weight's entries)."""
        if self._grouped is None:
            self._grouped = {}
            for k in self.files:
                head, dot, _ = k.partition(".weight.")
                self._grouped.setdefault(head + ".weight" if dot else k, []).append(k)
        return self._grouped.get(prefix, [])

    def info(self, key: str) -> tuple[int, np.dtype[Any]]:
        """(elements, numpy dtype) of `key` without reading it (FormatError where the
        checkpoint has no such tensor)."""
        if key not in self.files:
            raise FormatError(str(self.root), "missing", key)
        view = self._file(key).get_slice(key)
        code = view.get_dtype()
        known = DTYPES.get(code)
        if known is None or known.numpy is None:
            raise FormatError(str(self.root), f"dtype {code}, which has no numpy twin", key)
        return int(np.prod(view.get_shape())), known.numpy

    def close(self) -> None:
        self._open.clear()


def _gather_pieces(
    piece: torch.Tensor, spans: list[tuple[int, int]], length: int, group: Any
) -> torch.Tensor:
    """The whole array from each rank's piece (spans: where each rank's lies in it)."""
    longest = max(e - s for s, e in spans)
    padded = torch.zeros(longest, dtype=piece.dtype, device=piece.device)
    padded[: piece.numel()] = piece
    out = torch.empty(longest * len(spans), dtype=piece.dtype, device=piece.device)
    dist.all_gather_into_tensor(out, padded, group=group)
    whole = torch.empty(length, dtype=piece.dtype, device=piece.device)
    for r, (s, e) in enumerate(spans):
        whole[s:e] = out[r * longest : r * longest + (e - s)]
    return whole


def _quantize_rows(
    ckpt: _Checkpoint,
    key: str,
    layer: Linear4bit,
    a: int,
    b: int,
    dtype: torch.dtype,
    device: torch.device,
    group: Any,
    world: int,
) -> NF4Weight:
    """Rows [a, b) of the weight `key` quantized on `device` as the whole weight would be:
    the elements of the blocks they touch are read (a few rows around at most), and under
    double quantization the ranks' scales are gathered so that the nested scales are the
    whole weight's."""
    rows, cols = layer.out_features, layer.in_features
    got = ckpt.shape(key)
    if got != [rows, cols]:
        raise ValueError(f"{ckpt.root}: {key} has shape {got}, the layer [{rows}, {cols}]")
    layout = Layout(rows, cols, layer.blocksize, layer.double_quant, 0.0, dtype)
    bs = layer.blocksize
    span = layout.span(a, b)
    k0, k1 = span["absmax"]
    e0, e1 = k0 * bs, min(k1 * bs, layout.n)
    r0, r1 = e0 // cols, -(-e1 // cols)
    w = ckpt.rows(key, r0, r1).to(device=device, dtype=dtype).reshape(-1)
    w = w[e0 - r0 * cols : e1 - r0 * cols]
    codes, absmax = torch.ops.nybble.quantize(w, bs, "nf4")
    del w
    if not layer.double_quant:
        return NF4Weight.from_arrays(layout, codes, absmax, None, held=(a, b))
    per = rows // world
    spans = [layout.span(r * per, (r + 1) * per)["absmax"] for r in range(world)]
    whole = _gather_pieces(absmax, spans, layout.nblocks, group)
    nested_codes, absmax2, offset = _backend_double_quantize(whole)
    g0, g1 = k0 // NESTED_BLOCKSIZE, -(-k1 // NESTED_BLOCKSIZE)
    layout = Layout(rows, cols, bs, True, offset, dtype)
    return NF4Weight.from_arrays(
        layout,
        codes,
        nested_codes[k0:k1].contiguous(),
        absmax2[g0:g1].contiguous(),
        held=(a, b),
    )


class _Entries(Mapping[str, Any]):
    """The checkpoint's entries of one weight (`prefix` and `prefix.*`) as a mapping, each
    read whole when asked for (bnb.read_header asks only for the small ones)."""

    def __init__(self, ckpt: _Checkpoint, prefix: str) -> None:
        self.ckpt = ckpt
        self.names = ckpt.entries(prefix)

    def __getitem__(self, key: str) -> Any:
        if key not in self.names:
            raise KeyError(key)
        return self.ckpt.tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _stored_4bit(ckpt: _Checkpoint, key: str) -> bool:
    """Whether the checkpoint holds weight `key` 4-bit (bitsandbytes' entries, as bitsandbytes
    and nybble save them) rather than as floats."""
    head = f"{key}.quant_state.bitsandbytes__"
    return any(k.startswith(head) for k in ckpt.entries(key))


def _read_rows(
    ckpt: _Checkpoint,
    key: str,
    layer: Linear4bit,
    a: int,
    b: int,
    dtype: torch.dtype,
    device: torch.device,
) -> NF4Weight:
    """Rows [a, b) of the weight `key` stored 4-bit, as stored: its header checked
    (bnb.read_header: FormatError naming the entry), then only the codes and scales of the
    blocks the rows touch read (under double quantization, the nested groups they touch,
    whose scales are checked too), in the checkpoint's blocksize and double quantization."""
    header = bnb.read_header(_Entries(ckpt, key), key, ckpt.info)
    if header.codebook != "nf4":
        raise FormatError(
            str(ckpt.root),
            f"nybble.torch.Linear4bit holds NF4 weights; this one is {header.codebook}",
            header.key,
        )
    rows, cols = layer.out_features, layer.in_features
    if header.shape != (rows, cols):
        raise ValueError(
            f"{ckpt.root}: {key} has shape {list(header.shape)}, the layer [{rows}, {cols}]"
        )
    nested = header.nested_offset is not None
    bs = header.blocksize
    layout = Layout(rows, cols, bs, nested, header.nested_offset or 0.0, dtype)
    span = layout.span(a, b)
    k0, k1 = span["absmax"]
    # read whole nested groups, so that the scales read can be checked as they decode
    g = NESTED_BLOCKSIZE if nested else 1
    r0, r1 = k0 // g * g, min(-(-k1 // g) * g, layout.nblocks)
    c0, c1 = r0 * bs // 2, -(-min(r1 * bs, layout.n) // 2)
    absmax2 = ckpt.rows(f"{key}.nested_absmax", r0 // g, -(-r1 // g)) if nested else None
    packed = header.packed(
        ckpt.rows(key, c0, c1), ckpt.rows(f"{key}.absmax", r0, r1), absmax2, (r0, r1)
    )
    s0, s1 = (i - c0 for i in span["codes"])
    codes = torch.from_numpy(packed.codes[s0:s1].copy()).to(device)
    absmax2_held = None
    if packed.nested is not None:
        scales = torch.from_numpy(packed.nested.codes[k0 - r0 : k1 - r0].copy()).to(device)
        absmax2_held = torch.from_numpy(packed.nested.absmax2.copy()).to(device)
    else:
        assert packed.absmax is not None
        scales = torch.from_numpy(packed.absmax[k0 - r0 : k1 - r0].copy()).to(device)
    return NF4Weight.from_arrays(layout, codes, scales, absmax2_held, held=(a, b))


def load_sharded(
    path: str | os.PathLike[str],
    mesh: Any = None,
    *,
    quantization_config: Any = None,
    dtype: torch.dtype | None = None,
    device: Any = None,
    model_class: Any = None,
    **config_kwargs: Any,
) -> nn.Module:
    """A transformers model from a safetensors checkpoint, loaded for FSDP2 on `mesh` without
    any rank holding the whole model: parameters are created on the meta device; every linear
    layer `NybbleConfig` quantizes (`quantization_config`; default: the checkpoint's own
    4-bit config where it has one, as `pretrained_config` reads it, else `NybbleConfig()`)
    gets only this rank's rows (out_features / mesh size of them): a float weight's rows read
    and quantized on `device` (the codes and scales are those of quantizing the whole weight,
    nested scales included), a weight stored 4-bit (bitsandbytes' entries, as bitsandbytes
    and nybble save them) only those rows' codes and scales read, with the checkpoint's
    blocksize and double quantization (its header checked: FormatError naming the entry).
    The other parameters are read whole, one tensor at a time, in `dtype` (default: the
    config's). Then apply PEFT
    (`get_peft_model(model, register_lora(lora))`) and `shard_model(model, mesh)` on the same
    mesh; until then the model cannot run (each rank holds its rows only).

    The checkpoint's tensor names must be the model's parameter names (as for Llama, Qwen,
    Mistral...); `model_class` defaults to AutoModelForCausalLM; `config_kwargs` go to
    AutoConfig.from_pretrained.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from ._transformers import NybbleConfig, NybbleQuantizer, pretrained_config

    _require_distributed()
    mesh = mesh if mesh is not None else default_mesh()
    world, rank = mesh.size(), mesh.get_local_rank()
    group = mesh.get_group()
    qconfig = quantization_config
    if qconfig is None:
        stored = getattr(pretrained_config(path, **config_kwargs), "quantization_config", None)
        if stored is None:
            qconfig = NybbleConfig()
        else:
            qconfig = stored if isinstance(stored, NybbleConfig) else NybbleConfig(**stored)
    if not isinstance(qconfig, NybbleConfig):
        raise ValueError(
            f"quantization_config must be a NybbleConfig, got {type(qconfig).__name__}"
        )
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if mesh.device_type == "cuda"
            else torch.device(mesh.device_type)
        )
    device = torch.device(device)
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype or "float32"))
    cls = model_class or AutoModelForCausalLM
    with _parameters_on_meta():
        model = cls.from_config(config, dtype=dtype)
    NybbleQuantizer(qconfig)._process_model_before_weight_loading(model)
    ckpt = _Checkpoint(path)
    try:
        for name, layer in _linear4bits(model):
            rows = layer.out_features
            if rows % world:
                raise ValueError(
                    f"{name}: {rows} output rows do not split evenly over {world} ranks "
                    "(leave it unquantized with NybbleConfig(skip_modules=[...]))"
                )
            per = rows // world
            a, b, key = rank * per, (rank + 1) * per, f"{name}.weight"
            if _stored_4bit(ckpt, key):
                weight = _read_rows(ckpt, key, layer, a, b, dtype, device)
            else:
                weight = _quantize_rows(ckpt, key, layer, a, b, dtype, device, group, world)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer._buffers["absmax"] = None
            layer._buffers["absmax2"] = None
            layout = weight.nf4_layout  # a 4-bit checkpoint's own format
            layer.blocksize, layer.double_quant = layout.blocksize, layout.double_quant
            layer.offset = layout.offset
            layer.weight_dtype = dtype
        for pname, param in list(model.named_parameters()):
            if param.device.type != "meta":
                continue
            if pname not in ckpt:
                raise ValueError(f"{ckpt.root}: the checkpoint has no tensor {pname!r}")
            value = ckpt.tensor(pname)
            if list(value.shape) != list(param.shape):
                raise ValueError(
                    f"{ckpt.root}: {pname} has shape {list(value.shape)}, the model "
                    f"{list(param.shape)}"
                )
            module_name, _, attr = pname.rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters[attr] = nn.Parameter(
                value.to(device=device, dtype=dtype), requires_grad=param.requires_grad
            )
    finally:
        ckpt.close()
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    for module in model.modules():
        for bname, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device and buf.device.type != "meta":
                module._buffers[bname] = buf.to(device)
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise ValueError(
            f"{len(left)} parameter(s) got no value from the checkpoint, e.g. {left[0]}"
        )
    for _, layer in _linear4bits(model):
        layer.requires_grad_(False)
    return model


# --- saving the adapter -------------------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter whole on the host (a DTensor shard gathered from every rank)."""
    full = getattr(t, "full_tensor", None)
    if callable(full):
        t = full()
    return t.detach().to("cpu").contiguous()


def adapter_state(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The LoRA adapter's tensors whole, on the host, under PEFT's saved names
    (`base_model.model.<module>.lora_A.weight`, ...). Under FSDP every rank must call it (the
    shards are gathered)."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    peft_model = _unwrap(model)
    if not isinstance(peft_model, PeftModel):
        raise ValueError(f"expected a PEFT model (get_peft_model), got {type(peft_model).__name__}")
    state = {}
    for name, t in [*peft_model.named_parameters(), *peft_model.named_buffers()]:
        if "lora_" in name and f".{adapter_name}" in name:
            state[name] = _full(t)
    return dict(get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=adapter_name))


def save_adapter(
    model: nn.Module, directory: str | os.PathLike[str], adapter_name: str = "default"
) -> None:
    """Saves the LoRA adapter as PEFT's files (`PeftModel.from_pretrained` loads them), its
    tensors gathered from every rank and written by rank 0: into a new directory built aside
    and renamed into place (it appears whole or not at all), or over an existing adapter
    file by file (each renamed into place complete, the weights first). Every rank must call
    it; it returns on every rank once the files are in place (an error on rank 0 is raised
    on every rank)."""
    from peft import PeftModel

    peft_model = _unwrap(model)
    if not isinstance(peft_model, PeftModel):
        raise ValueError(f"expected a PEFT model (get_peft_model), got {type(peft_model).__name__}")
    state = adapter_state(model, adapter_name)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    error = None
    if rank == 0:
        try:
            target = Path(directory)
            if adapter_name != "default":
                target = target / adapter_name
            _write_adapter(peft_model, adapter_name, state, target)
        except Exception as e:  # reported to every rank below
            error = f"{type(e).__name__}: {e}"
    if distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise OSError(f"saving the adapter to {directory} failed on rank 0: {error}")


def _write_adapter(
    peft_model: Any, adapter_name: str, state: dict[str, torch.Tensor], target: Path
) -> None:
    from safetensors.torch import save as safetensors_bytes

    config = peft_model.peft_config[adapter_name]
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target}: exists and is not a directory")
    staging = temporary_directory(target)
    try:
        inference_mode = config.inference_mode
        name_or_path = config.base_model_name_or_path
        try:
            config.inference_mode = True
            if config.base_model_name_or_path is None:
                config.base_model_name_or_path = (
                    peft_model.base_model.model.__dict__.get("name_or_path") or None
                )
            config.save_pretrained(str(staging))
        finally:
            config.inference_mode = inference_mode
            config.base_model_name_or_path = name_or_path
        weights = staging / ADAPTER_WEIGHTS
        weights.write_bytes(safetensors_bytes(state, metadata={"format": "pt"}))
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            finish_temporary(staging / name, new_file_mode())
        if not target.exists():
            os.rename(staging, target)  # the new directory appears whole
            fsync_directory(target.parent)
            return
        remove_stale_temporaries(target, (ADAPTER_WEIGHTS, ADAPTER_CONFIG))
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):  # each file replaced whole
            os.replace(staging / name, target / name)
        fsync_directory(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


__all__ = [
    "adapter_state",
    "data_parallel",
    "decoder_layers",
    "default_mesh",
    "load_sharded",
    "save_adapter",
    "set_quant_storage",
    "shard_model",
]
