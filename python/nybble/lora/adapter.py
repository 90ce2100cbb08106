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
from .._checkpoint_io import Checkpoint, find_groups, load_group
from .._files import (
    fsync_directory,
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
#: Where PEFT saves the new rows of trainable tokens (trainable_token_indices), after the
#: embedding's module path.
TOKENS_SUFFIX = ".token_adapter.trainable_tokens_delta"
#: Modules whose weights PEFT saves whole beside LoRA's when the vocabulary was resized
#: (`save_embedding_layers`), as `<module path>.weight`.
EMBEDDING_LAYERS = ("embed_tokens", "lm_head")
#: Config fields naming the tensors saved beside LoRA's.
EXTRA_FIELDS = ("modules_to_save", "trainable_token_indices")
#: PEFT's trainable_token_indices: token ids (of the input embedding), or ids per module.
TokenIndices = list[int] | dict[str, list[int]]
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
        #: Tensors PEFT saves beside LoRA's, keyed as in the file: whole copies of the
        #: `modules_to_save` (`base_model.model.lm_head.weight`, ...), the new rows of
        #: trainable tokens (`...embed_tokens.token_adapter.trainable_tokens_delta`), embeddings
        #: of a resized vocabulary. Kept as read (dtype too) and saved back unchanged; the
        #: layers do not use them, `nybble merge` puts them in the merged model.
        self.extra_tensors: dict[str, np.ndarray] = {}
        #: adapter_config.json's fields that name them, kept and saved back as read.
        self.modules_to_save: list[str] | None = None
        self.trainable_token_indices: TokenIndices | None = None

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
            modules_to_save=self.modules_to_save,
            trainable_token_indices=self.trainable_token_indices,
        )
        return dict(sorted(out.items()))

    def state_dict(self) -> dict[str, np.ndarray]:
        """The adapter's tensors under PEFT's keys: the layers' as host float32 arrays, and
        `extra_tensors` as they are (ValueError for one the config's modules_to_save and
        trainable_token_indices do not account for, which PEFT would not load)."""
        for key, value in self.extra_tensors.items():
            problem = _extra_problem(key, value, self.modules_to_save, self.trainable_token_indices)
            if problem is not None:
                raise ValueError(f"extra_tensors[{key!r}] {problem}")
        out: dict[str, np.ndarray] = {
            k: np.ascontiguousarray(v) for k, v in self.extra_tensors.items()
        }
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
        config_text = (json.dumps(self.peft_config(), indent=2, allow_nan=False) + "\n").encode()
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
        fsync_directory(target)
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
        adapter.extra_tensors = dict(files.extras)
        adapter.modules_to_save = files.modules_to_save
        adapter.trainable_token_indices = files.trainable_token_indices
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
    weights file, each module's tensors by PEFT suffix (`lora_A.weight`, ...), the tensors
    saved beside LoRA's by key (LoraAdapter.extra_tensors) and the fields naming them."""

    config: LoraConfig
    raw: dict[str, Any]
    weights_path: Path
    modules: dict[str, dict[str, np.ndarray]]
    extras: dict[str, np.ndarray]
    modules_to_save: list[str] | None
    trainable_token_indices: TokenIndices | None


def read_adapter(directory: str | os.PathLike[str]) -> AdapterFiles:
    """Reads an adapter directory written by PEFT or nybble, checking everything a loader
    relies on: the config field by field, that the weights belong with it (when they record
    their config), that every module has lora_A and lora_B (and the DoRA magnitude) of the
    configured rank, that every other tensor is one PEFT saves beside LoRA's for the config's
    modules_to_save / trainable_token_indices (or a resized vocabulary's embeddings).
    FormatError naming the file and field otherwise."""
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
    raw = read_json(config_path)
    if not isinstance(raw, dict):
        raise FormatError(config_path, "not a JSON object")
    modules_to_save = _modules_to_save(raw.get("modules_to_save"), config_path)
    indices = _token_indices(raw.get("trainable_token_indices"), config_path)
    try:  # LoraConfig reads the LoRA fields; the two naming extra tensors are read here
        config = LoraConfig.from_peft({k: v for k, v in raw.items() if k not in EXTRA_FIELDS})
    except FormatError as e:
        raise FormatError(config_path, e.problem, e.field) from None
    with safetensors_io.SafeTensorsFile(weights_path) as f:
        _check_pair(f.metadata, config_path, weights_path)
        tensors = {k: np.asarray(f.get(k)) for k in f.keys()}
    modules: dict[str, dict[str, np.ndarray]] = {}
    extras: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        if not key.startswith(KEY_PREFIX):
            raise FormatError(weights_path, f"does not start with {KEY_PREFIX!r}", key)
        rest = key[len(KEY_PREFIX) :]
        suffix = next((x for x in KEY_SUFFIXES if rest.endswith("." + x)), None)
        if suffix is not None:
            modules.setdefault(rest[: -len(suffix) - 1], {})[suffix] = value
            continue
        problem = _extra_problem(key, value, modules_to_save, indices)
        if problem is not None:
            raise FormatError(weights_path, problem, key)
        extras[key] = value
    if not modules:
        raise FormatError(weights_path, "holds no LoRA tensors")
    for name, parts in modules.items():
        _check_parts(parts, config.for_module(name), name, weights_path)
    return AdapterFiles(config, raw, weights_path, modules, extras, modules_to_save, indices)


def extra_tensor_kind(
    key: str, modules_to_save: list[str] | None, indices: TokenIndices | None
) -> str | None:
    """What a tensor of an adapter file that is not LoRA's is, as PEFT saves them:
    "modules_to_save" (a parameter of a module whose path ends with one of modules_to_save,
    PEFT's match), "trainable_tokens" (the rows of `token_rows`), "embedding" (a resized
    vocabulary's embeddings, `embed_tokens` / `lm_head` weights); None for anything else."""
    rest = key.removeprefix(KEY_PREFIX)
    if rest.endswith(TOKENS_SUFFIX):
        return "trainable_tokens" if token_rows(key, indices) is not None else None
    parts = rest.split(".")
    for i in range(1, len(parts)):
        if any(".".join(parts[:i]).endswith(m) for m in modules_to_save or ()):
            return "modules_to_save"
    if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in EMBEDDING_LAYERS:
        return "embedding"
    return None


def token_rows(key: str, indices: TokenIndices | None) -> list[int] | None:
    """The token ids whose rows a `...token_adapter.trainable_tokens_delta` tensor holds, in
    its order: trainable_token_indices as a list (PEFT's input embedding), or the ids of the
    first of its keys the module's path ends with."""
    module = key.removeprefix(KEY_PREFIX).removesuffix(TOKENS_SUFFIX)
    if indices is None or isinstance(indices, list):
        return indices
    return next((ids for name, ids in indices.items() if module.endswith(name)), None)


def _extra_problem(
    key: str, value: np.ndarray, modules_to_save: list[str] | None, indices: TokenIndices | None
) -> str | None:
    kind = extra_tensor_kind(key, modules_to_save, indices)
    if kind is None:
        return (
            "is not a LoRA tensor nybble reads, nor one that the config's modules_to_save or "
            "trainable_token_indices names"
        )
    rows = token_rows(key, indices)
    if kind == "trainable_tokens" and rows is not None:
        if value.ndim != 2 or value.shape[0] != len(rows) or value.dtype.kind not in "fV":
            return (
                f"expected a 2-D float tensor of {len(rows)} rows (one per trainable token), "
                f"got {value.dtype} {list(value.shape)}"
            )
    return None


def _modules_to_save(value: Any, path: Path) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise FormatError(
        path, f"expected a list of module names or null, got {_short(value)}", "modules_to_save"
    )


def _token_indices(value: Any, path: Path) -> TokenIndices | None:
    def ids(v: Any) -> bool:
        return isinstance(v, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in v
        )

    if value is None:
        return None
    if ids(value):
        return list(value)
    if isinstance(value, dict) and all(
        isinstance(k, str) and k and ids(v) for k, v in value.items()
    ):
        return {k: list(v) for k, v in value.items()}
    raise FormatError(
        path,
        "expected a list of token ids, an object of module names to lists of token ids, or "
        f"null, got {_short(value)}",
        "trainable_token_indices",
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + "..." + text[-10:]


def _checkpoint_weights(path: Path, modules: list[str]) -> dict[str, Any]:
    """The frozen weights of `modules` from a checkpoint directory: dense arrays, or
    NF4Tensors where the checkpoint stores them 4-bit (nybble's or bitsandbytes' layout)."""
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
    fsync_directory(directory)


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
    fsync_directory(directory)


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
