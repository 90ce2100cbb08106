"""Trainer: LoRA, QLoRA or full fine-tuning of a DecoderLM with AdamW, on the CPU or the GPU
(docs/training.md). One call of `train_batch` is one micro-batch: forward, backward,
and the optimizer's accumulation (an update every `accumulation_steps` calls, clipped to
`max_grad_norm` when set). Everything that decides the numbers comes from the arguments and
`seed`, so two trainers built alike give the same losses on one device; a checkpoint holds
what a resumed run needs to continue exactly where it stopped.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from .. import backends, safetensors_io
from .._files import remove_stale_temporaries, replace_file, write_temporary
from ..backends import Array
from ..errors import FormatError
from ..formats import numpy_dtype
from ..lora.adapter import LoraAdapter
from ..lora.config import LoraConfig
from ..lora.layers import QLoraLinear
from ..lora.optim import AdamW
from ..models.tokenizer import Tokenizer
from ..safetensors_io import Entry
from ..tensor import NF4Tensor
from .config import TransformerConfig
from .functional import IGNORE_INDEX
from .generate import Generation
from .generate import generate as generate_ids
from .linear import LoraProjection
from .model import DecoderLM
from .pretrained import PretrainedWeights
from .schedule import LRSchedule
from .weights import WeightSource

#: The optimizer sees all trainable parameters as this one flat array.
FLAT = "parameters"
#: The checkpoint file's metadata key holding the trainer's record (JSON).
CHECKPOINT_KEY = "nybble.train"
CHECKPOINT_VERSION = 2  # 2: dropout stored as draw counts (1: numpy generator states)
#: Settings that may differ between the run that saved a checkpoint and the one resuming
#: it without changing a single number.
_FREE_ON_RESUME = ("gradient_checkpointing",)

Batch = tuple[Any, Any]


class Trainer:
    """Trains a `TransformerConfig` model from seeded random weights.

    lora: a LoraConfig (its target_modules pick the projections; A and B train, the base is
    frozen) or None for full fine-tuning (every weight trains). quant: None or "nf4" (QLoRA:
    every projection's base stored in NF4; needs lora). device: "cpu" or "cuda".
    compute_dtype: the activations' dtype, "float32" (the CPU's default) or "bfloat16" (the
    GPU's default). Parameters, gradients and optimizer states are float32 throughout.
    """

    def __init__(
        self,
        model_config: TransformerConfig,
        lora: LoraConfig | None = None,
        lr: float = 1e-3,
        accumulation_steps: int = 1,
        quant: str | None = None,
        device: str = "cpu",
        seed: int = 0,
        *,
        max_grad_norm: float | None = None,
        weight_decay: float = 0.0,
        compute_dtype: str | None = None,
        gradient_checkpointing: bool = False,
        blocksize: int = 64,
        double_quant: bool = False,
        weights: WeightSource | None = None,
        base_model: str | None = None,
        schedule: LRSchedule | None = None,
        frozen: bool = False,
    ) -> None:
        if not isinstance(model_config, TransformerConfig):
            raise ValueError(
                f"model_config must be a TransformerConfig, got {type(model_config).__name__}"
            )
        if lora is not None:
            if not isinstance(lora, LoraConfig):
                raise ValueError(f"lora must be a LoraConfig or None, got {type(lora).__name__}")
            lora.validate(need_targets=True)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not 0 < lr < math.inf:
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        if schedule is not None and not isinstance(schedule, LRSchedule):
            raise ValueError(f"schedule must be an LRSchedule or None, got {schedule!r}")
        if device not in backends.DEVICES:
            raise ValueError(f"device must be one of {backends.DEVICES}, got {device!r}")
        if compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be float32 or bfloat16, got {compute_dtype!r}")
        self.config = model_config.validate()
        self.lora = lora
        self.quant = quant
        self.device = device
        self.seed = seed
        self.blocksize = blocksize
        self.double_quant = double_quant
        #: where the base model's weights came from (None: seeded random weights)
        self.base_model = base_model
        #: the peak learning rate, scaled for each update by `schedule`
        self.peak_lr = float(lr)
        self.schedule = schedule or LRSchedule()
        #: the model's tokenizer (set by from_pretrained where the files carry one)
        self.tokenizer: Tokenizer | None = None
        self.backend = backends.get(device)
        #: the activations' dtype (by default the device's: `Backend.default_compute_dtype`)
        self.compute_dtype: str = compute_dtype or self.backend.default_compute_dtype
        self.model = DecoderLM(
            model_config,
            self.backend,
            lora=lora,
            quant=quant,
            compute_dtype=self.compute_dtype,
            seed=seed,
            gradient_checkpointing=gradient_checkpointing,
            blocksize=blocksize,
            double_quant=double_quant,
            weights=weights,
            frozen=frozen,
        )
        if self.model.adapter is not None and base_model is not None:
            self.model.adapter.base_model_name_or_path = base_model
        self.optimizer = AdamW(
            {FLAT: self.model.flat},
            lr=lr,
            weight_decay=weight_decay,
            accumulation_steps=accumulation_steps,
            max_grad_norm=max_grad_norm,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        lora: LoraConfig | None = None,
        quant: str | None = None,
        device: str = "cpu",
        **kwargs: Any,
    ) -> Trainer:
        """A trainer over a pretrained model: `path` is a Hugging Face checkpoint folder (dense,
        or 4-bit from bitsandbytes or `nybble quantize`, read as stored), a Hub id whose files
        are in the local HF cache, or a .gguf file. With quant="nf4" every frozen projection
        is quantized as it is read, one tensor at a time. The tokenizer, where the files carry
        one, is `trainer.tokenizer`. Other keyword arguments are the constructor's
        (`frozen=True`, without lora: a model only to run, e.g. for `generate`)."""
        from ..models import open_model

        with open_model(path) as files:
            where = str(files.path / "config.json") if files.path.is_dir() else str(files.path)
            config = TransformerConfig.from_hf(files.config, where=where)
            source = PretrainedWeights(files)
            trainer = cls(
                config, lora, quant=quant, device=device, weights=source,
                base_model=os.fspath(path), **kwargs,
            )  # fmt: skip
            unused = [
                n
                for n in source.unused()
                if not (n == "lm_head.weight" and config.tie_word_embeddings)
                and not n.endswith("rotary_emb.inv_freq")
            ]
            if unused:
                raise FormatError(
                    files.path,
                    f"holds {len(unused)} tensor(s) the {config.model_type} model does not use "
                    "(another architecture?)",
                    unused[0],
                )
            try:
                trainer.tokenizer = files.tokenizer()
            except FormatError:
                trainer.tokenizer = None  # token ids still work; text needs a tokenizer
        return trainer

    # --- what it is ---------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer updates taken (a micro-batch that only accumulates is not one)."""
        return self.optimizer.step_count

    @property
    def micro_steps(self) -> int:
        """Micro-batches accumulated towards the next update."""
        return self.optimizer.micro_steps

    @property
    def is_lora(self) -> bool:
        return self.lora is not None

    @property
    def gradient_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        self.model.gradient_checkpointing = bool(on)

    @property
    def adapter(self) -> LoraAdapter | None:
        """The LoRA layers as a LoraAdapter (PEFT files, merged weights), None without LoRA."""
        return self.model.adapter

    def lora_layers(self) -> dict[str, Any]:
        """The LoraLinear / QLoraLinear layers by module path (empty without LoRA)."""
        return {name: p.layer for name, p in self.model.lora_projections.items()}

    def named_parameters(self) -> dict[str, Any]:
        """The trainable parameters by name (device arrays, updated in place): PEFT's
        `<module>.lora_A.weight` / `.lora_B.weight` with LoRA, HF's weight names without."""
        return self.model.named_parameters()

    def state_dict(self) -> dict[str, np.ndarray]:
        """The base model's weights by HF name, host float32 (NF4 bases dequantized): with a
        saved adapter, what HF + PEFT need to compute the same losses."""
        return self.model.state_dict()

    def settings(self) -> dict[str, Any]:
        """Everything that decides the numbers of a run, as JSON values."""
        return {
            "model_config": self.config.to_dict(),
            "lora": None if self.lora is None else _lora_record(self.lora),
            "quant": self.quant,
            "compute_dtype": self.compute_dtype,
            "seed": self.seed,
            "blocksize": self.blocksize,
            "double_quant": self.double_quant,
            "lr": self.peak_lr,
            "schedule": self.schedule.to_dict(),
            "weight_decay": self.optimizer.weight_decay,
            "accumulation_steps": self.optimizer.accumulation_steps,
            "max_grad_norm": self.optimizer.max_grad_norm,
            "gradient_checkpointing": self.gradient_checkpointing,
            "base_model": self.base_model,
        }

    # --- training -----------------------------------------------------------------------------

    def train_batch(self, inputs: Any, targets: Any, starts: Any = None) -> float:
        """One micro-batch: inputs and targets are token ids [batch, seq] (or [seq]), each
        target the token that follows its input (IGNORE_INDEX to skip one); `starts` (packed
        rows, same shape) the index where each token's sample begins in its row. Returns the
        mean cross-entropy before the update."""
        ids, tgt, count, first = self._batch(inputs, targets, starts)
        self.model.train(True)
        loss = self.model.forward_backward(ids, tgt, count, first)
        self.optimizer.lr = self.peak_lr * self.schedule.factor(self.step)
        self.optimizer.step({FLAT: self.model.flat_gradients()})
        return float(loss)

    def train_epoch(self, batches: Iterable[Batch]) -> float:
        """`train_batch` over (inputs, targets) pairs; returns their mean loss."""
        losses = [self.train_batch(inputs, targets) for inputs, targets in batches]
        if not losses:
            raise ValueError("batches: expected at least one (inputs, targets) pair, got none")
        return float(np.mean(losses))

    def loss(self, inputs: Any, targets: Any, starts: Any = None) -> float:
        """The mean cross-entropy of a batch without training (dropout off, nothing kept)."""
        ids, tgt, count, first = self._batch(inputs, targets, starts)
        self.model.train(False)
        try:
            return float(self.model.loss(ids, tgt, count, first))
        finally:
            self.model.train(True)

    def _batch(
        self, inputs: Any, targets: Any, starts: Any = None
    ) -> tuple[Array, Array, int, Array | None]:
        vocab = self.config.vocab_size
        ids = self._host_tokens(inputs, "inputs")
        tgt = self._host_tokens(targets, "targets")
        if ids.shape != tgt.shape:
            raise ValueError(f"targets must have the shape of inputs {ids.shape}, got {tgt.shape}")
        if ids.size == 0:
            raise ValueError(f"inputs: expected at least one token, got shape {ids.shape}")
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(
                f"inputs: token ids must be in [0, {vocab}), got [{ids.min()}, {ids.max()}]"
            )
        bad = (tgt >= vocab) | ((tgt < 0) & (tgt != IGNORE_INDEX))
        if bad.any():
            raise ValueError(
                f"targets: expected token ids in [0, {vocab}) or {IGNORE_INDEX} (ignored), "
                f"got {int(tgt[bad][0])}"
            )
        count = int((tgt >= 0).sum())
        if count == 0:
            raise ValueError(f"targets: every target is {IGNORE_INDEX} (ignored); nothing to learn")
        first = None
        if starts is not None:
            host = self._host_tokens(starts, "starts")
            if host.shape != ids.shape:
                raise ValueError(
                    f"starts must have the shape of inputs {ids.shape}, got {host.shape}"
                )
            within = np.arange(ids.shape[1])[None, :]
            if (host < 0).any() or (host > within).any():
                raise ValueError("starts: each token's sample start must lie in [0, its own index]")
            first = self.backend.from_host(host.astype(np.int32))
        return self.backend.from_host(ids), self.backend.from_host(tgt), count, first

    def _host_tokens(self, a: Any, what: str) -> np.ndarray:
        source = backends.of(a)
        host = source.to_host(source.asarray(a, what))
        if host.dtype.kind not in "iu":
            raise ValueError(f"{what}: expected integer token ids, got dtype {host.dtype}")
        if host.ndim == 1:
            host = host[None, :]
        if host.ndim != 2:
            raise ValueError(f"{what}: expected shape [batch, seq] or [seq], got {host.shape}")
        return np.ascontiguousarray(host, dtype=np.int64)

    # --- trying the result ---------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        chat: bool | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        """Continues a prompt with the model as trained so far (train/generate.py): text
        (through the tokenizer; with `chat`, default when the tokenizer has a chat template,
        as a user turn of the chat template) or token ids. Stops at the tokenizer's end
        tokens. `on_text` gets the text as it is made (streaming); the result's `text` holds
        all of it."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            if tok is None:
                raise ValueError("a text prompt needs the model's tokenizer; pass token ids")
            if chat is None:
                chat = tok.chat_template is not None
            if chat:
                text = tok.render_chat([{"role": "user", "content": prompt}], True)
                ids = tok.encode(text, add_special_tokens=False)
            else:
                ids = tok.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
        made: list[int] = []
        shown = ""

        def stream(token: int) -> None:
            nonlocal shown
            made.append(token)
            if on_text is not None and tok is not None:
                text = tok.decode(made)
                if not text.endswith("\ufffd"):  # a character cut between tokens: wait
                    on_text(text[len(shown) :])
                    shown = text

        result = generate_ids(
            self.model,
            ids,
            max_new_tokens,
            temperature,
            top_p,
            seed,
            tok.stop_ids if tok is not None else (),
            stream,
        )
        if tok is not None:
            result.text = tok.decode(result.ids)
            if on_text is not None and len(result.text) > len(shown):
                on_text(result.text[len(shown) :])
        return result

    # --- adapters -----------------------------------------------------------------------------

    def save_adapter(self, directory: str | os.PathLike[str]) -> None:
        """The LoRA layers as PEFT's adapter_config.json + adapter_model.safetensors (PEFT
        loads them onto the HF model with this model's weights: `state_dict()`)."""
        adapter = self._require_adapter()
        adapter.save_pretrained(directory)

    def load_adapter(self, directory: str | os.PathLike[str]) -> None:
        """Reads A and B (and DoRA's magnitude) from PEFT files into this trainer's LoRA
        layers. The files must hold exactly this trainer's LoRA layers with the same rank and
        scaling (ValueError naming the first that differs)."""
        self._require_adapter()
        mine = self.model.lora_projections
        base = {f"{name}.weight": _base_of(p) for name, p in mine.items()}
        loaded = LoraAdapter.from_pretrained(directory, base)
        if set(loaded.layers) != set(mine):
            missing = sorted(set(mine) - set(loaded.layers))
            extra = sorted(set(loaded.layers) - set(mine))
            raise ValueError(
                f"{directory}: the adapter's layers differ from this trainer's "
                f"(missing {missing}, not in this model {extra})"
            )
        for name, layer in loaded.layers.items():
            target = mine[name].layer
            if layer.scaling != target.scaling or layer.config.use_dora != target.config.use_dora:
                raise ValueError(
                    f"{directory}: layer {name!r} has scaling {layer.scaling} "
                    f"(dora {layer.config.use_dora}), this trainer {target.scaling} "
                    f"(dora {target.config.use_dora})"
                )
            target.set_lora_a(layer.lora_a)
            target.set_lora_b(layer.lora_b)
            if layer.lora_magnitude is not None:
                target.set_lora_magnitude(layer.lora_magnitude)

    def _require_adapter(self) -> LoraAdapter:
        if self.model.adapter is None:
            raise ValueError(
                "this trainer fine-tunes every weight (lora=None): it has no adapter; "
                "save_model() writes the weights"
            )
        return self.model.adapter

    def save_model(self, directory: str | os.PathLike[str]) -> None:
        """The base model as an HF checkpoint: config.json and model.safetensors (float32,
        HF names; NF4 bases dequantized). With full fine-tuning, the trained weights."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        safetensors_io.save(self.state_dict(), target / "model.safetensors", {"format": "pt"})
        config = self.config.to_hf()
        config["torch_dtype"] = "float32"
        text = (json.dumps(config, indent=2, allow_nan=False) + "\n").encode()
        replace_file(write_temporary(target / "config.json", text), target / "config.json")

    def save_merged(
        self, directory: str | os.PathLike[str], dtype: str = "bfloat16", overwrite: bool = False
    ) -> None:
        """The model with its LoRA layers merged (W + scaling·B·A, the base dequantized) as an
        HF checkpoint in `dtype`: config.json, the weights (sharded past 5 GB as transformers
        shards), and the tokenizer; written a tensor at a time into a staging folder put in
        place whole (what PEFT's merge_and_unload + save_pretrained give)."""
        from ..checkpoint._output import DEFAULT_MAX_SHARD_SIZE, OutputDirectory, ShardedWriter

        code = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype)
        if code is None:
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
        model = self.model
        to_host = self.backend.to_host
        layers = self.lora_layers()

        projections = {p.name: p for layer in model.layers for p in layer.proj.values()}

        def value(name: str) -> np.ndarray:
            module, leaf = name.rsplit(".", 1)
            if leaf == "weight" and module in layers:
                return np.asarray(to_host(layers[module].merged_weight("float32")))
            if leaf == "weight" and module in projections:
                return np.asarray(to_host(projections[module].base_weight()), np.float32)
            return np.asarray(to_host(model.weights[name]), np.float32)

        shapes = model.weight_shapes()
        entries = [Entry(name, code, shape) for name, shape in shapes.items()]
        with OutputDirectory(directory, overwrite=overwrite) as out:
            writer = ShardedWriter(out, entries, DEFAULT_MAX_SHARD_SIZE)
            try:
                for name in shapes:
                    writer.write(name, value(name).astype(numpy_dtype(dtype)))
                writer.finish()
            except BaseException:
                writer.abort()
                raise
            config = self.config.to_hf()
            config["torch_dtype"] = dtype
            out.write_json("config.json", config)
            if self.tokenizer is not None:
                for name, data in self.tokenizer.files().items():
                    out.write_bytes(name, data)
            out.commit()

    # --- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(
        self, path: str | os.PathLike[str], extra: Mapping[str, Any] | None = None
    ) -> None:
        """Everything a resumed run needs, in one safetensors file written atomically (a
        temporary beside it renamed into place): the trainable parameters, AdamW's moments
        and pending accumulation, its counters, the dropout draw counts, the settings, and
        `extra` (JSON values the caller wants back: a data position, a loss history)."""
        state = self.optimizer.state_dict()
        to_host = self.backend.to_host
        tensors = {
            "parameters": np.asarray(to_host(self.model.flat)),
            "optimizer.m": np.asarray(to_host(state["m"][FLAT])),
            "optimizer.v": np.asarray(to_host(state["v"][FLAT])),
            "optimizer.accum": np.asarray(to_host(state["accum"][FLAT])),
        }
        record = {
            "version": CHECKPOINT_VERSION,
            "settings": self.settings(),
            "layout": [[name, list(v.shape)] for name, v in self.model.views.items()],
            "step_count": state["step_count"],
            "micro_steps": state["micro_steps"],
            "dropout": {
                name: p.dropout_state()
                for name, p in self.model.lora_projections.items()
                if p.dropout_state() is not None
            },
            "extra": dict(extra or {}),
        }
        target = Path(path)
        remove_stale_temporaries(target.parent, (target.name,))
        metadata = {CHECKPOINT_KEY: json.dumps(record, allow_nan=False)}
        safetensors_io.save(tensors, target, metadata)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restores a `save_checkpoint` file into this trainer, which must have been built
        with the same settings (FormatError naming the first that differs, or a malformed
        part); returns its `extra`."""
        where = Path(path)
        with safetensors_io.SafeTensorsFile(where) as f:
            raw = f.metadata.get(CHECKPOINT_KEY)
            if raw is None:
                raise FormatError(where, "not a nybble training checkpoint", CHECKPOINT_KEY)
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError) as e:
                raise FormatError(where, f"not valid JSON ({e})", CHECKPOINT_KEY) from None
            if not isinstance(record, dict) or record.get("version") != CHECKPOINT_VERSION:
                raise FormatError(where, "unknown checkpoint version", "version")
            self._check_settings(record.get("settings"), where)
            layout = [[name, list(v.shape)] for name, v in self.model.views.items()]
            if record.get("layout") != layout:
                raise FormatError(where, "holds other parameters than this trainer", "layout")
            n = int(self.model.flat.size)
            tensors = {}
            for key in ("parameters", "optimizer.m", "optimizer.v", "optimizer.accum"):
                if key not in f:
                    raise FormatError(where, "missing", key)
                a = f.get(key)
                if a.dtype != np.float32 or a.shape != (n,):
                    raise FormatError(
                        where, f"expected float32 [{n}], got {a.dtype} {list(a.shape)}", key
                    )
                tensors[key] = np.array(a)
        step_count, micro = record.get("step_count"), record.get("micro_steps")
        if not isinstance(step_count, int) or not _count(step_count):
            raise FormatError(where, f"expected a count, got {step_count!r}", "step_count")
        if not isinstance(micro, int) or not _count(micro):
            raise FormatError(where, f"expected a count, got {micro!r}", "micro_steps")
        if micro >= self.optimizer.accumulation_steps:
            raise FormatError(
                where,
                f"{micro} micro-batches pending, more than accumulation_steps allows",
                "micro_steps",
            )
        dropout = record.get("dropout")
        if not isinstance(dropout, dict) or not set(dropout) <= set(self.model.lora_projections):
            raise FormatError(where, "names layers this trainer does not have", "dropout")
        extra = record.get("extra")
        if not isinstance(extra, dict):
            raise FormatError(where, "expected an object", "extra")
        from_host = self.backend.from_host
        self.model.flat[...] = from_host(tensors["parameters"])
        state = self.optimizer.state_dict()
        state.update(
            step_count=step_count,
            micro_steps=micro,
            m={FLAT: from_host(tensors["optimizer.m"])},
            v={FLAT: from_host(tensors["optimizer.v"])},
            accum={FLAT: from_host(tensors["optimizer.accum"])},
        )
        self.optimizer.load_state_dict(state)
        for name, value in dropout.items():
            try:
                self.model.lora_projections[name].set_dropout_state(value)
            except (TypeError, ValueError, KeyError) as e:
                raise FormatError(
                    where, f"bad dropout draw count ({e})", f"dropout.{name}"
                ) from None
        return extra

    def _check_settings(self, saved: Any, where: Path) -> None:
        mine = self.settings()
        if not isinstance(saved, dict):
            raise FormatError(where, "missing", "settings")
        for key, value in mine.items():
            if key in _FREE_ON_RESUME:
                continue
            theirs = saved.get(key)
            if json.loads(json.dumps(value)) != theirs:
                raise FormatError(
                    where,
                    f"was saved by a trainer with {key}={theirs!r}; this one has {value!r}",
                    key,
                )


def _lora_record(config: LoraConfig) -> dict[str, Any]:
    record = {f.name: getattr(config, f.name) for f in fields(config)}
    record["target_modules"] = (
        config.target_modules
        if isinstance(config.target_modules, str)
        else list(config.target_modules)
    )
    record["rank_pattern"] = [list(p) for p in config.rank_pattern]
    record["alpha_pattern"] = [list(p) for p in config.alpha_pattern]
    return record


def _base_of(projection: LoraProjection) -> NF4Tensor | Array:
    layer = projection.layer
    return layer.qweight if isinstance(layer, QLoraLinear) else layer.weight


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


__all__ = ["CHECKPOINT_KEY", "FLAT", "IGNORE_INDEX", "Trainer"]
