"""LoraAdapter: named LoRA/QLoRA layers of one model, and PEFT's adapter files (docs/lora.md).

Saving is safe against interruption: after a kill at any moment the directory loads as the
adapter it held before or as the new one, whole. A directory that did not exist is built
aside and renamed into place whole. Over an existing adapter both new files are written in
full into a staging directory inside it, which one rename makes the pending save
(`PENDING`); its files then replace the old ones one by one and it is removed. While a
pending save exists, its files are the adapter (a file already moved out of it is the new
one in the directory): the loader reads them from there, and the next save first finishes
moving them. The weights also record the SHA-256 of the config they belong with, so files
of two saves put together by hand are refused on load instead of loading silently.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import backends, safetensors_io
from .._files import (
    remove_stale_temporaries,
    replace_file,
    temporary_directory,
    write_temporary,
)
from ..errors import FormatError
from ..tensor import NF4Tensor
from .config import CONFIG_FILE, LoraConfig, read_json
from .layers import LoraLinear, QLoraLinear

WEIGHTS_FILE = "adapter_model.safetensors"
#: PEFT keys: base_model.model.<module path>.lora_A.weight (etc.).
KEY_PREFIX = "base_model.model."
KEY_SUFFIXES = {
    "lora_A.weight": "lora_a",
    "lora_B.weight": "lora_b",
    "lora_magnitude_vector": "lora_magnitude",
}
#: The weights file's metadata key holding the SHA-256 of the config saved with it.
CONFIG_DIGEST_KEY = "nybble.adapter_config_sha256"
#: A save's complete new files inside the adapter directory, until they are moved in.
PENDING = ".nybble-adapter-pending"
#: Files of an adapter, in the order a save moves them into place.
ADAPTER_FILES = (WEIGHTS_FILE, CONFIG_FILE)

Layer = LoraLinear | QLoraLinear


def module_name(name: str) -> str:
    """A module path from a layer name given with or without its `.weight`."""
    return name.removesuffix(".weight")


class LoraAdapter:
    """LoRA layers by module path (e.g. `model.layers.0.self_attn.q_proj`)."""

    def __init__(self, config: LoraConfig, base_model_name_or_path: str | None = None) -> None:
        self.config = config.validate()
        self.base_model_name_or_path = (
            None if base_model_name_or_path is None else os.fspath(base_model_name_or_path)
        )
        self.layers: dict[str, Layer] = {}

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LoraAdapter({len(self.layers)} layers, r={c.r}, lora_alpha={c.alpha}, "
            f"target_modules={c.target_modules!r}, trainable={self.summary()['trainable']})"
        )

    def add_layer(
        self,
        name: str,
        weight: Any,
        bias: Any = None,
        config: LoraConfig | None = None,
    ) -> Layer:
        """A LoraLinear over a dense weight, or a QLoraLinear over an NF4Tensor, for the
        module `name` (given with or without `.weight`), which the config's target_modules
        must name; rank_pattern / alpha_pattern pick its r and alpha."""
        if not isinstance(name, str):
            raise ValueError(f"layer name must be a string, got {type(name).__name__}")
        name = module_name(name)
        if not name or any(part == "" for part in name.split(".")):
            raise ValueError(f"layer name must be a dotted module path, got {name!r}")
        if name in self.layers:
            raise ValueError(f"a layer named {name!r} already exists")
        cfg = config or self.config
        if config is None and not cfg.targets(name):
            raise ValueError(
                f"{name!r} is not one of the adapter's target_modules {cfg.target_modules!r}"
            )
        cfg = cfg.for_module(name)
        layer: Layer
        if isinstance(weight, NF4Tensor):
            layer = QLoraLinear(weight, cfg, bias=bias, name=name)
        else:
            layer = LoraLinear(weight, cfg, bias=bias, name=name)
        self.layers[name] = layer
        return layer

    def __getitem__(self, name: str) -> Layer:
        key = module_name(name)
        if key not in self.layers:
            raise KeyError(f"no layer named {name!r}; layers: {sorted(self.layers)}")
        return self.layers[key]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and module_name(name) in self.layers

    def __len__(self) -> int:
        return len(self.layers)

    def forward_layer(self, name: str, x: Any) -> Any:
        return self[name].forward(x)

    def backward_layer(self, name: str, grad_y: Any) -> Any:
        return self[name].backward(grad_y)

    def merge_all(self) -> None:
        for layer in self.layers.values():
            layer.merge()

    def unmerge_all(self) -> None:
        for layer in self.layers.values():
            layer.unmerge()

    def check(self) -> None:
        """Every layer's `check()`: NonFiniteError for a non-finite input seen on the GPU."""
        for layer in self.layers.values():
            layer.check()

    def merged_weights(self, dtype: Any = "float32") -> dict[str, Any]:
        """{"<name>.weight": W + ΔW} for every layer, without changing any layer."""
        return {f"{n}.weight": layer.merged_weight(dtype) for n, layer in self.layers.items()}

    def parameters(self) -> dict[str, Any]:
        """All trainable arrays as {"<name>.lora_A.weight": ...} (for an optimizer)."""
        return {
            f"{n}.{k}": v for n, layer in self.layers.items() for k, v in layer.parameters().items()
        }

    def gradients(self) -> dict[str, Any]:
        return {
            f"{n}.{k}": v for n, layer in self.layers.items() for k, v in layer.gradients().items()
        }

    def summary(self) -> dict[str, Any]:
        trainable = sum(layer.trainable_params for layer in self.layers.values())
        frozen = sum(layer.total_params - layer.trainable_params for layer in self.layers.values())
        return {
            "layers": len(self.layers),
            "trainable": trainable,
            "frozen": frozen,
            "ratio": trainable / (trainable + frozen) if trainable + frozen else 0.0,
            "r": self.config.r,
            "alpha": self.config.alpha,
        }

    def train(self, mode: bool = True) -> LoraAdapter:
        for layer in self.layers.values():
            layer.train(mode)
        return self

    def eval(self) -> LoraAdapter:
        return self.train(False)

    # --- PEFT files -----------------------------------------------------------------------

    def peft_config(self) -> dict[str, Any]:
        """adapter_config.json as PEFT writes it (target_modules: the leaves of the layers
        added, together with those the config names)."""
        out = self.config.to_peft()
        if not isinstance(self.config.target_modules, str):
            leaves = {n.rsplit(".", 1)[-1] for n in self.layers}
            out["target_modules"] = sorted(leaves | set(self.config.target_modules))
        out.update(
            task_type=None,
            base_model_name_or_path=self.base_model_name_or_path,
            inference_mode=True,
            modules_to_save=None,
        )
        return dict(sorted(out.items()))

    def state_dict(self) -> dict[str, np.ndarray]:
        """The adapter's tensors under PEFT's keys, as host float32 arrays."""
        out: dict[str, np.ndarray] = {}
        for name, layer in self.layers.items():
            for suffix, attr in KEY_SUFFIXES.items():
                v = getattr(layer, attr)
                if v is not None:
                    host = backends.of(v).to_host(v)
                    out[f"{KEY_PREFIX}{name}.{suffix}"] = np.ascontiguousarray(host, np.float32)
        return out

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Writes adapter_config.json and adapter_model.safetensors as PEFT does, so that an
        interrupted save leaves a directory that loads as the old adapter or as the new one,
        whole (see the module docstring)."""
        if not self.layers:
            raise ValueError("the adapter has no layers to save")
        config_text = (json.dumps(self.peft_config(), indent=2) + "\n").encode("utf-8")
        metadata = {
            "format": "pt",
            CONFIG_DIGEST_KEY: hashlib.sha256(config_text).hexdigest(),
        }
        tensors = self.state_dict()
        target = Path(directory)
        if not target.exists():
            _save_new_directory(target, tensors, metadata, config_text)
            return
        if not target.is_dir():
            raise NotADirectoryError(f"{target}: exists and is not a directory")
        _finish_pending(target)  # a killed save's new files: the adapter until moved in
        remove_stale_temporaries(target, ADAPTER_FILES)
        staging = temporary_directory(target / WEIGHTS_FILE)
        try:
            _write_files(staging, tensors, metadata, config_text)
            os.rename(staging, target / PENDING)  # the new adapter is the one from here on
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _fsync_directory(target)
        _finish_pending(target)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        base: Mapping[str, Any] | str | os.PathLike[str],
        bias: Mapping[str, Any] | None = None,
        is_trainable: bool = False,
    ) -> LoraAdapter:
        """Reads an adapter written by PEFT (or by save_pretrained). `base` maps each module
        path (with or without `.weight`) to the frozen weight — a dense array, or an
        NF4Tensor for QLoRA — or is a Hugging Face checkpoint directory (dense, or 4-bit in
        nybble's or bitsandbytes' layout) whose weights are read for the adapter's modules.
        As PEFT does, the adapter comes back in eval mode (no dropout) unless `is_trainable`.
        FormatError for anything malformed, naming file and field."""
        files = read_adapter(directory)
        if isinstance(base, (str, os.PathLike)):
            base = _checkpoint_weights(Path(base), sorted(files.modules))
        bases = {module_name(k): v for k, v in base.items()}
        biases = {module_name(k.removesuffix(".bias")): v for k, v in (bias or {}).items()}
        name_or_path = files.raw.get("base_model_name_or_path")
        adapter = cls(files.config, name_or_path if isinstance(name_or_path, str) else None)
        for name, parts in sorted(files.modules.items()):
            if name not in bases:
                raise KeyError(
                    f"the adapter has a layer {name!r} but base has no {name + '.weight'!r}"
                )
            layer_cfg = files.config.for_module(name)
            layer = adapter.add_layer(name, bases[name], biases.get(name), layer_cfg)
            layer.set_lora_a(parts["lora_A.weight"])
            layer.set_lora_b(parts["lora_B.weight"])
            if layer_cfg.use_dora:
                layer.set_lora_magnitude(parts["lora_magnitude_vector"])
        return adapter.train(is_trainable)


@dataclass(frozen=True)
class AdapterFiles:
    """A PEFT adapter directory as read and checked: the config (and its raw JSON), the
    weights file, and each module's tensors by PEFT suffix (`lora_A.weight`, ...)."""

    config: LoraConfig
    raw: dict[str, Any]
    weights_path: Path
    modules: dict[str, dict[str, np.ndarray]]


def read_adapter(directory: str | os.PathLike[str]) -> AdapterFiles:
    """Reads an adapter directory written by PEFT or nybble, checking everything a loader
    relies on: the config field by field, that the weights belong with it (when they record
    their config), that every module has lora_A and lora_B (and the DoRA magnitude) of the
    configured rank. FormatError naming the file and field otherwise."""
    d = Path(directory)
    for attempt in range(3):
        try:
            return _read_adapter(d)
        except FormatError:
            # A live save may have moved a pending file between looking and opening it.
            if attempt == 2 or not (d / PENDING).exists():
                raise
    raise AssertionError("unreachable")


def _read_adapter(d: Path) -> AdapterFiles:
    pending = _pending(d)
    config_path, weights_path = (
        d / PENDING / name if name in pending else d / name for name in (CONFIG_FILE, WEIGHTS_FILE)
    )
    config = LoraConfig.from_peft(config_path)
    raw = read_json(config_path)
    with safetensors_io.SafeTensorsFile(weights_path) as f:
        _check_pair(f.metadata, config_path, weights_path)
        tensors = {k: np.asarray(f.get(k)) for k in f.keys()}
    modules = _group_by_module(tensors, weights_path)
    if not modules:
        raise FormatError(weights_path, "holds no LoRA tensors")
    for name, parts in modules.items():
        _check_parts(parts, config.for_module(name), name, weights_path)
    return AdapterFiles(config, raw, weights_path, modules)


def _checkpoint_weights(path: Path, modules: list[str]) -> dict[str, Any]:
    """The frozen weights of `modules` from a checkpoint directory: dense arrays, or
    NF4Tensors where the checkpoint stores them 4-bit (nybble's or bitsandbytes' layout)."""
    from ..checkpoint import Checkpoint, find_groups, load_group

    with Checkpoint(path) as ckpt:
        groups = find_groups(ckpt.names(), path)
        out: dict[str, Any] = {}
        for name in modules:
            key = f"{name}.weight"
            if key in groups:
                out[name] = load_group(groups[key], ckpt.read, ckpt.file_of)
            elif key in ckpt:
                out[name] = np.array(ckpt.read(key), copy=True)
            else:
                raise FormatError(path, f"has no weight for the adapter's module {name!r}", key)
    return out


def _save_new_directory(
    target: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str], config: bytes
) -> None:
    """Builds the adapter in a temporary directory beside `target` and renames it into place:
    `target` appears complete or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_directory(target)
    try:
        _write_files(staging, tensors, metadata, config)
        os.rename(staging, target)  # fails if target appeared meanwhile: nothing overwritten
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_files(
    directory: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str], config: bytes
) -> None:
    """Both files of an adapter, complete and flushed, in a directory of the saver's own."""
    weights = directory / WEIGHTS_FILE
    replace_file(safetensors_io.save_temporary(tensors, weights, metadata), weights)
    replace_file(write_temporary(directory / CONFIG_FILE, config), directory / CONFIG_FILE)
    _fsync_directory(directory)


def _pending(directory: Path) -> list[str]:
    """The files of a pending save that are the adapter's (see the module docstring). Only
    its config left means the weights were moved in, so the weights in the directory record
    that config's digest; if they do not, other weights were written since (by another
    tool) and the pending save is stale: none."""
    pending = directory / PENDING
    names = [n for n in ADAPTER_FILES if (pending / n).is_file()]
    if names == [CONFIG_FILE]:
        try:
            with safetensors_io.SafeTensorsFile(directory / WEIGHTS_FILE) as f:
                digest = f.metadata.get(CONFIG_DIGEST_KEY)
            current = digest == hashlib.sha256((pending / CONFIG_FILE).read_bytes()).hexdigest()
        except (OSError, FormatError):
            current = False
        return names if current else []
    return names


def _finish_pending(directory: Path) -> None:
    """Moves a pending save's files into place (a killed save's: each move is one rename,
    and the files still pending are the adapter meanwhile), then removes it."""
    pending = directory / PENDING
    if not pending.is_dir():
        return
    for name in _pending(directory):  # the weights first, as a save moves them
        os.replace(pending / name, directory / name)
    shutil.rmtree(pending, ignore_errors=True)
    _fsync_directory(directory)


def _fsync_directory(path: Path) -> None:
    """Flushes a directory's entries (the renames in it) to disk, where the system can."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check_pair(metadata: dict[str, str], config_path: Path, weights_path: Path) -> None:
    """Refuses weights that record the digest of another config than the one beside them."""
    digest = metadata.get(CONFIG_DIGEST_KEY)
    if digest is None:  # written by PEFT or another tool: nothing to check against
        return
    actual = hashlib.sha256(config_path.read_bytes()).hexdigest()
    if actual != digest:
        raise FormatError(
            config_path,
            f"does not belong with {weights_path.name} (an interrupted save, or files of two "
            "different saves); save the adapter again",
        )


def _group_by_module(
    tensors: dict[str, np.ndarray], path: Path
) -> dict[str, dict[str, np.ndarray]]:
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        if not key.startswith(KEY_PREFIX):
            raise FormatError(path, f"does not start with {KEY_PREFIX!r}", key)
        rest = key[len(KEY_PREFIX) :]
        for suffix in KEY_SUFFIXES:
            if rest.endswith("." + suffix):
                modules.setdefault(rest[: -len(suffix) - 1], {})[suffix] = value
                break
        else:
            raise FormatError(path, "is not a LoRA tensor nybble reads", key)
    return modules


def _check_parts(parts: dict[str, np.ndarray], config: LoraConfig, name: str, path: Path) -> None:
    """The tensors of one module: present, 2-D (1-D magnitude), float, rank as configured."""
    for suffix in ("lora_A.weight", "lora_B.weight"):
        if suffix not in parts:
            raise FormatError(path, "missing", f"{KEY_PREFIX}{name}.{suffix}")
    if config.use_dora and "lora_magnitude_vector" not in parts:
        raise FormatError(
            path, "missing (use_dora is set)", f"{KEY_PREFIX}{name}.lora_magnitude_vector"
        )
    for suffix, array in parts.items():
        key = f"{KEY_PREFIX}{name}.{suffix}"
        want = 1 if suffix == "lora_magnitude_vector" else 2
        if array.ndim != want or (array.dtype.kind != "f" and array.dtype.name != "bfloat16"):
            raise FormatError(
                path,
                f"expected a {want}-D float tensor, got {array.dtype} {list(array.shape)}",
                key,
            )
    a, b = parts["lora_A.weight"], parts["lora_B.weight"]
    if a.shape[0] != config.r or b.shape[1] != config.r:
        raise FormatError(
            path,
            f"rank {a.shape[0]} (lora_B: {b.shape[1]}) but the config gives r={config.r}",
            f"{KEY_PREFIX}{name}.lora_A.weight",
        )
