"""The normalized inputs of an estimate: one training setup, validated once."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .arch import MLP_PROJECTIONS, PROJECTIONS, SHARED_EXPERT_GATE, Architecture
from .presets import MODEL_PRESETS
from .quant import (
    QUANTIZED_FORMATS,
    check_blocksize,
    normalize_dtype,
    normalize_format,
    numpy_scalar,
)

#: The training loops an estimate can model (memory.timeline says how they differ): "plain",
#: the plain loop of docs/estimator.md (new input ids each step, labels = the ids, no
#: attention mask, no KV cache), and "benchmark", the step loop of
#: benchmarks/memory/measure_peft_bnb.py --loop benchmark.
LOOPS = ("plain", "benchmark")

#: How a run on several GPUs is spread (memory.distributed): "fsdp", torch's fully sharded
#: data parallel (FSDP2's `fully_shard` for nybble's torch layer, FSDP1 for bitsandbytes), or
#: "ddp", a whole replica on every GPU.
STRATEGIES = ("fsdp", "ddp")
#: The most GPUs an estimate takes (far beyond one host: the per-GPU figure is the same).
MAX_GPUS = 4096

#: Optimizers whose state the estimate knows.
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
_OPTIMIZER_ALIASES = {
    "adam": "adamw",
    "adamw_torch": "adamw",
    "adamw-8bit": "adamw8bit",
    "adamw_8bit": "adamw8bit",
    "adamw_bnb_8bit": "adamw8bit",
    "paged_adamw_8bit": "adamw8bit",
}

ModelLike = str | Path | Mapping[str, Any] | Architecture

#: Names of `targets` that mean PEFT's "all-linear".
ALL_LINEAR = ("all-linear", "all_linear", "all")

#: Model types whose fused experts PEFT adapts under "all-linear" on transformers 5 (PEFT 0.21,
#: peft.utils.transformers_weight_conversion): it maps the transformers 4 names the string
#: stood for (the router `gate`, the experts' w1/w3 or gate_proj/up_proj, w2 or down_proj) to
#: the fused parameters and wraps each in a `lora.ParamWrapper`. Mixtral is listed by PEFT
#: itself, Qwen3-MoE through transformers' conversion table (as a Qwen2-MoE-style model);
#: Qwen2-MoE is no key of that table, so its experts keep no adapter.
PEFT_FUSED_EXPERT_TYPES = ("mixtral", "qwen3_moe")

#: The fused parameters of a mixture-of-experts layer PEFT adapts (`Architecture.expert_shapes`).
EXPERT_PARAMETERS = ("router", "gate_up_proj", "down_proj")

#: The replay walks every layer of every step (about 7 ms a layer): deeper configs are refused
#: rather than left running.
MAX_LAYERS = 256
#: Ranges of the run's sizes: far beyond any GPU, short of sizes nothing can count.
MAX_BATCH = 1 << 20
MAX_SEQ_LEN = 1 << 24
MAX_LORA_R = 1 << 16


def optimizer_states(optimizer: str, elems: int, pbytes: int) -> list[int]:
    """Bytes of each optimizer-state tensor kept for one parameter of `elems` elements."""
    if optimizer == "adamw":
        return [elems * pbytes] * 2  # exp_avg, exp_avg_sq
    if optimizer == "adamw8bit":
        # bitsandbytes: uint8 states with one float32 absmax per 256 values for tensors of
        # at least 4096 elements; smaller ones keep 32-bit states
        if elems >= 4096:
            return [elems, 4 * -(-elems // 256)] * 2
        return [4 * elems] * 2
    return []  # SGD without momentum


def optimizer_temporaries(optimizer: str, elems: int, pbytes: int) -> list[int]:
    """Bytes of each temporary the optimizer step makes for one parameter of `elems` elements:
    torch's foreach AdamW takes the square root of the second moments into a new list."""
    return [elems * pbytes] if optimizer == "adamw" else []


def resolve_model(model: ModelLike) -> Architecture:
    """A preset name, a path to an HF `config.json` (or its folder), a Hub id whose config is
    in the local Hugging Face cache (`Qwen/Qwen3-4B`), a config dict, or an `Architecture`."""
    if isinstance(model, Architecture):
        return model
    if isinstance(model, Mapping):
        return Architecture.from_config(model)
    if isinstance(model, (str, Path)):
        text = str(model)
        if "\0" in text:
            raise ValueError(f"model {text!r}: a name or path holds no NUL character")
        key = text.strip().lower()
        if key in MODEL_PRESETS:
            return Architecture.from_config(MODEL_PRESETS[key], name=key)
        path = Path(model)
        if path.exists() or text.endswith(".json") or path.is_absolute() or text.startswith("."):
            return Architecture.from_json(path)
        if HUB_ID.fullmatch(text):
            cached = hub_cache_config(text)
            if cached is None:
                raise ValueError(
                    f"{text!r} looks like a Hugging Face Hub id, but its config.json is not in "
                    f"the local cache ({hub_cache_dir()}); nothing is downloaded: pass the path "
                    "of its config.json"
                )
            arch = Architecture.from_json(cached)
            return replace(arch, name=text)
        known = ", ".join(sorted(MODEL_PRESETS))
        raise ValueError(
            f"unknown model {text!r}: not a preset, a config.json path or a Hub id in the local "
            f"cache (presets: {known})"
        )
    raise ValueError(
        f"model must be a preset name, a config.json path or a dict, got {type(model).__name__}"
    )


#: A Hub repository id: `owner/name` (the Hub's own rules: letters, digits, -, _, .).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}")


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded repositories: HF_HUB_CACHE, else HF_HOME/hub,
    else ~/.cache/huggingface/hub (XDG_CACHE_HOME replaces ~/.cache)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "huggingface" / "hub"


def hub_cache_config(repo_id: str) -> Path | None:
    """The cached config.json of a Hub model: the snapshot refs/main points to, else the most
    recently written snapshot that has one; None when none is cached."""
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    try:
        main = (repo / "refs" / "main").read_text().strip()
    except OSError:
        main = ""
    if main and (snapshots / main / "config.json").is_file():
        return snapshots / main / "config.json"
    try:
        found = [p / "config.json" for p in snapshots.iterdir() if (p / "config.json").is_file()]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_targets(targets: str | Sequence[str], arch: Architecture) -> tuple[str, ...]:
    """PEFT's `target_modules` on `arch`: "all-linear" (every linear layer but lm_head, as PEFT
    finds them: never the fused experts of a mixture of experts) or a list of names."""
    present = arch.linear_names()
    if not isinstance(targets, (str, list, tuple)):
        raise ValueError(
            "targets must be 'all-linear', 'attention', 'mlp', a comma-separated string or a "
            f"list of projection names, got {targets!r}"
        )
    if isinstance(targets, str):
        key = targets.strip().lower()
        if key in ALL_LINEAR:
            return present
        if key in ("attention", "attn"):
            return PROJECTIONS[:4]
        if key == "mlp":
            return tuple(t for t in present if t not in PROJECTIONS[:4])
        names = [t.strip() for t in targets.split(",") if t.strip()]
    else:
        names = [t.strip() if isinstance(t, str) else t for t in targets]
    if not names:
        raise ValueError("targets must name at least one projection (or be 'all-linear')")
    out: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"targets must be names of linear layers, got {name!r}")
        short = name.rsplit(".", 1)[-1]
        if short not in present:
            raise ValueError(
                f"unknown LoRA target {name!r} (known: all-linear, {', '.join(present)})"
            )
        if short not in out:
            out.append(short)
    return tuple(t for t in present if t in out)


def _loop(loop: str) -> str:
    key = str(loop).strip().lower()
    if key not in LOOPS:
        raise ValueError(f"unknown training loop {loop!r} (known: {', '.join(LOOPS)})")
    return key


def parallelism(gpus: Any, strategy: Any, offload: Any) -> tuple[int, str | None, bool]:
    """`gpus`, `strategy`, `offload` checked and completed: the strategy defaults to "fsdp"
    when several GPUs (or offload) are asked for, and stays None for one GPU without one (the
    single-GPU estimate)."""
    n = _positive_int(gpus, "gpus", MAX_GPUS)
    if strategy is not None and not isinstance(strategy, str):
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    key = None if strategy is None else strategy.strip().lower()
    if key is not None and key not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    off = _flag(offload, "offload")
    if key is None and (n > 1 or off):
        key = "fsdp"
    if off and key == "ddp":
        raise ValueError(
            "offload is FSDP's CPU offload (the shards, gradients and optimizer states on the "
            "host); DDP keeps a whole replica on every GPU: use strategy='fsdp' with offload"
        )
    return n, key, off


def _embedding_units(value: Any, strategy: str | None, arch: Architecture) -> bool:
    """`embedding_units` checked: FSDP's, and for a model whose embeddings are not tied."""
    units = _flag(value, "embedding_units")
    if units and strategy != "fsdp":
        raise ValueError(
            f"embedding_units makes the embeddings FSDP units of their own: it needs "
            f"strategy='fsdp' (got {strategy!r})"
        )
    if units and not arch.lm_head_params:
        raise ValueError(
            "embedding_units: the model's input and output embeddings share their weight "
            "(tie_word_embeddings), which two FSDP units cannot"
        )
    return units


def _flag(value: Any, name: str) -> bool:
    """True or False (numpy's too); anything else is refused rather than read by its truth:
    "no" and "false" are true."""
    if not (isinstance(value, bool) or numpy_scalar(value, "b")):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _positive_int(value: Any, name: str, maximum: int) -> int:
    if numpy_scalar(value, "iu"):  # numpy's integers are integers
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value


@dataclass(frozen=True)
class TrainingSetup:
    """Everything an estimate depends on, validated. Make one with `TrainingSetup.create`."""

    arch: Architecture
    quant: str
    blocksize: int
    double_quant: bool
    lora_r: int
    targets: tuple[str, ...]
    lora_dtype: str
    lora_dropout: float
    optimizer: str
    batch: int
    seq_len: int
    grad_checkpointing: bool
    compute_dtype: str
    loop: str = "plain"
    #: the fused expert parameters PEFT adapts too (`EXPERT_PARAMETERS`, or none)
    expert_targets: tuple[str, ...] = ()
    #: GPUs the run is spread over, how (`STRATEGIES`, None: one GPU, no distributed
    #: runtime), and whether FSDP offloads the shards to the host (memory.distributed)
    gpus: int = 1
    strategy: str | None = None
    offload: bool = False
    #: FSDP2 with the input and output embeddings as units of their own (`shard_model(...,
    #: embedding_units=True)`)
    embedding_units: bool = False

    @property
    def distributed(self) -> bool:
        """Whether the run goes through torch.distributed (a strategy was given)."""
        return self.strategy is not None

    @property
    def quantized(self) -> bool:
        return self.quant in QUANTIZED_FORMATS

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def lora_tensors(self) -> list[int]:
        """Element counts of every LoRA tensor, in the order of the model's parameters: layer
        by layer, A then B of each target (`layer_lora_tensors`)."""
        out: list[int] = []
        for layer in range(self.arch.num_layers):
            out += self.layer_lora_tensors(layer)
        return out

    @property
    def lora_parameters(self) -> int:
        """Trainable parameters: every LoRA tensor's elements."""
        return sum(self.lora_tensors())

    def layer_lora_tensors(self, layer: int) -> list[int]:
        """Element counts of the LoRA tensors of decoder layer `layer`: A then B per target
        linear, then those of the adapted expert parameters (`expert_lora_tensors`)."""
        shapes = self.arch.linear_shapes(layer)
        out: list[int] = []
        for t in self.targets:
            if t in shapes:
                out_f, in_f = shapes[t]
                out += [self.lora_r * in_f, out_f * self.lora_r]
        if self.expert_targets and self.arch.is_sparse(layer):
            for name in self.expert_order():
                out += self.expert_lora_tensors(name)
        return out

    def expert_order(self) -> tuple[str, ...]:
        """The adapted expert parameters in the order of the model's modules: the router is
        registered before the experts in Mixtral, after them in Qwen3-MoE."""
        experts = tuple(n for n in EXPERT_PARAMETERS[1:] if n in self.expert_targets)
        router = ("router",) if "router" in self.expert_targets else ()
        return experts + router if self.arch.model_type == "qwen3_moe" else router + experts

    def expert_rank(self, name: str) -> int:
        """PEFT's rank for an expert parameter: `gate_up_proj` fuses two transformers 4 targets
        (w1 and w3, gate_proj and up_proj), so its rank (and alpha) is doubled."""
        return 2 * self.lora_r if name == "gate_up_proj" else self.lora_r

    def expert_lora_tensors(self, name: str) -> list[int]:
        """Element counts of A and B of PEFT's `lora.ParamWrapper` on expert parameter `name`
        (`Architecture.expert_shapes`: experts x out x in): A is `nn.Linear(in, r * experts)`,
        B `nn.Linear(r * experts, out)`; the router is one 2-D weight (experts out, hidden in)."""
        experts, out_f, in_f = self.arch.expert_shapes()[name]
        rank = self.expert_rank(name) * experts
        return [rank * in_f, out_f * rank]

    @classmethod
    def create(
        cls,
        model: ModelLike,
        *,
        quant: str = "nf4",
        blocksize: int = 64,
        double_quant: bool = True,
        lora_r: int = 16,
        targets: str | Sequence[str] = "all-linear",
        lora_dtype: str = "float32",
        lora_dropout: float = 0.0,
        optimizer: str = "adamw",
        batch: int = 1,
        seq_len: int = 2048,
        grad_checkpointing: bool = True,
        compute_dtype: str = "bfloat16",
        loop: str = "plain",
        gpus: int = 1,
        strategy: str | None = None,
        offload: bool = False,
        embedding_units: bool = False,
    ) -> TrainingSetup:
        arch = resolve_model(model)
        if arch.num_layers > MAX_LAYERS:
            raise ValueError(
                f"num_hidden_layers is {arch.num_layers}: the estimator replays every layer of "
                f"a run and takes at most {MAX_LAYERS} (the deepest released models have 126)"
            )
        fmt = normalize_format(quant)
        r = _positive_int(lora_r, "lora_r", MAX_LORA_R)
        tgt = resolve_targets(targets, arch)
        experts: tuple[str, ...] = ()
        if (
            isinstance(targets, str)
            and targets.strip().lower() in ALL_LINEAR
            and arch.model_type in PEFT_FUSED_EXPERT_TYPES
            and arch.num_sparse_layers
        ):
            # PEFT moves the MLP names to the fused parameters: a dense layer's MLP (Qwen3-MoE's
            # mlp_only_layers) keeps no adapter
            experts = EXPERT_PARAMETERS
            tgt = tuple(t for t in tgt if t not in MLP_PROJECTIONS)
        for layer in (0, arch.num_layers - 1):
            shapes = arch.linear_shapes(layer)
            for t in tgt:
                if t in shapes and t != SHARED_EXPERT_GATE and r > min(shapes[t]):
                    raise ValueError(f"lora_r {r} exceeds min(in, out) = {min(shapes[t])} of {t}")
        if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)):
            raise ValueError(f"lora_dropout must be a number in [0, 1), got {lora_dropout!r}")
        if not 0.0 <= float(lora_dropout) < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {lora_dropout}")
        if experts and lora_dropout:
            raise ValueError(
                f"lora_dropout must be 0 with targets='all-linear' on {arch.model_type}: PEFT "
                "adapts its fused experts with lora.ParamWrapper, which refuses dropout; to "
                "use dropout, target the attention only (targets='q_proj,k_proj,v_proj,o_proj')"
            )
        n_gpus, strat, off = parallelism(gpus, strategy, offload)
        opt = str(optimizer).strip().lower()
        opt = _OPTIMIZER_ALIASES.get(opt, opt)
        if opt not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r} (known: {', '.join(OPTIMIZERS)})")
        return cls(
            arch=arch,
            quant=fmt,
            blocksize=check_blocksize(blocksize) if fmt in QUANTIZED_FORMATS else blocksize,
            double_quant=_flag(double_quant, "double_quant") and fmt in QUANTIZED_FORMATS,
            lora_r=r,
            targets=tgt,
            lora_dtype=normalize_dtype(lora_dtype, "lora_dtype"),
            lora_dropout=float(lora_dropout),
            optimizer=opt,
            batch=_positive_int(batch, "batch", MAX_BATCH),
            seq_len=_positive_int(seq_len, "seq_len", MAX_SEQ_LEN),
            grad_checkpointing=_flag(grad_checkpointing, "grad_checkpointing"),
            compute_dtype=normalize_dtype(compute_dtype, "compute_dtype"),
            loop=_loop(loop),
            expert_targets=experts,
            gpus=n_gpus,
            strategy=strat,
            offload=off,
            embedding_units=_embedding_units(embedding_units, strat, arch),
        )

    def with_(self, **changes: Any) -> TrainingSetup:
        if "batch" in changes:
            _positive_int(changes["batch"], "batch", MAX_BATCH)
        if "seq_len" in changes:
            _positive_int(changes["seq_len"], "seq_len", MAX_SEQ_LEN)
        if "lora_r" in changes:
            _positive_int(changes["lora_r"], "lora_r", MAX_LORA_R)
        for name in ("grad_checkpointing", "double_quant"):
            if name in changes:
                _flag(changes[name], name)
        if {"gpus", "strategy", "offload"} & set(changes):
            gpus, strategy, offload = parallelism(
                changes.get("gpus", self.gpus),
                changes.get("strategy", self.strategy),
                changes.get("offload", self.offload),
            )
            changes.update(gpus=gpus, strategy=strategy, offload=offload)
        if {"embedding_units", "strategy"} & set(changes):
            changes["embedding_units"] = _embedding_units(
                changes.get("embedding_units", self.embedding_units),
                changes.get("strategy", self.strategy),
                self.arch,
            )
        return replace(self, **changes)
