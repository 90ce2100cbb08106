"""Mutation fuzzing of the estimator's inputs (docs/testing.md): Hugging Face config.json files
seeded from the presets (written as files, layers cut to 2 so that a case stays cheap), and the
keyword arguments of `nybble.estimate_memory`.

Every case goes through `TrainingSetup.create(path, ...)`, which reads and checks everything
`estimate_memory` reads before it replays; one case in twenty (and every case that sets an
argument only the estimate reads: gpu, context, framework) also runs the whole
`estimate_memory(path, ...)` when the model is small (the replay costs about 10 ms a layer,
more with many experts). A case passes when it ends
in a FormatError (a config file; a ValueError where the run does not fit the model) or a
ValueError/KeyError/TypeError (an argument), or is
accepted and the reference agrees: the file is strict JSON, every field was read as written
(or as transformers defaults it), and the estimate's breakdown adds up to its total.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import nybble
from nybble.memory import MODEL_PRESETS, TrainingSetup
from nybble.memory.arch import MODEL_TYPES
from nybble.memory.estimate import MemoryEstimate
from nybble.memory.frameworks import ReplayLimitError
from tests.fuzzing import (
    ARGUMENT_ERRORS,
    FILE_ERRORS,
    Raw,
    Suite,
    cases_for,
    check,
    check_generator,
    dumps,
    hostile_value,
    mutate_json,
    mutate_json_text,
    pick,
    run_suite,
    scratch_directory,
    strict_json_or_none,
)

#: Layers of every seed config: the replay's cost grows with them.
SEED_LAYERS = 2
#: The whole estimate runs only for models this small (about 30 ms each).
MAX_FULL_LAYERS = 4
MAX_FULL_EXPERTS = 8
#: Fields of the configs the estimator reads (and a few it does not).
CONFIG_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "qkv_bias",
    "hidden_act",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "text_config",
    "_name_or_path",
    "torch_dtype",
    "rope_scaling",
)
INT_FIELDS = {
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
}
#: Keyword arguments of estimate_memory, with good and bad values.
ARGUMENTS: dict[str, list[Any]] = {
    "quant": ["nf4", "fp4", "int8", "bf16", "float32", "NF4", "nf8", "", None, 4],
    "blocksize": [32, 64, 4096, 63, 0, -64, 8192, 64.0, "64", True, None, 2**64],
    "double_quant": [True, False, 1, "no", None],
    "lora_r": [1, 2, 8, 16, 64, 0, -1, 2**16, 2**16 + 1, 2**63, 1.5, "8", True, None],
    "targets": [
        "all-linear",
        "attention",
        "mlp",
        "q_proj,v_proj",
        ["q_proj"],
        [],
        "",
        "lm_head",
        [1],
        ("k_proj", "k_proj"),
        None,
        "gate_proj",
    ],
    "lora_dtype": ["float32", "bf16", "float16", "int8", "", None],
    "optimizer": ["adamw", "adamw8bit", "sgd", "paged_adamw_8bit", "lion", None, 1],
    "batch": [1, 2, 64, 0, -1, 2**20, 2**20 + 1, 2**63, 1.0, "2", True, None],
    "seq_len": [1, 7, 64, 2048, 0, -5, 2**24, 2**24 + 1, 2**70, 2.5, "128", None],
    "grad_checkpointing": [True, False, 0, "yes"],
    "compute_dtype": ["bfloat16", "float16", "float32", "fp8", None],
    "framework": ["peft-bnb", "nybble", "PEFT-BNB", "", None, 3],
    "lora_dropout": [0.0, 0.1, 0.999, 1.0, -0.1, float("nan"), float("inf"), "0.1", True],
    "loop": ["plain", "benchmark", "PLAIN", "other", None],
    "context": [None, 0, "751MiB", "1GB", -1, "-1GB", "1e999", 2**80, float("nan"), "x"],
    "gpu": [None, "rtx4090", "h100", "24GB", "0GB", 24, 0, -1, 2**80, "9" * 40, "gpu?", 1.5],
}
#: estimate_memory's arguments for several GPUs (read by the whole estimate only).
SEVERAL_GPUS: dict[str, list[Any]] = {
    "gpus": [1, 2, 4, 8, 3, 0, -1, 2**40, 1.5, 2.0, "2", True, None],
    "strategy": ["fsdp", "ddp", "FSDP", "zero3", "", None, 1],
    "offload": [True, False, 1, "yes", None],
    "embedding_units": [True, False, 1, "yes", None],
    "framework": ["nybble-torch", "peft-bnb", "nybble"],
}


@dataclass
class EstimatorCase:
    config: bytes
    arguments: dict[str, Any]
    full: bool
    description: str
    path: Path = field(default=Path("config.json"))


def _seed_configs() -> dict[str, dict[str, Any]]:
    seeds: dict[str, dict[str, Any]] = {}
    for name, preset in MODEL_PRESETS.items():
        cfg = dict(preset, num_hidden_layers=SEED_LAYERS)
        if "num_experts" in cfg:  # the replay's cost grows with the routed experts too
            cfg["num_experts"] = MAX_FULL_EXPERTS
            cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], MAX_FULL_EXPERTS)
        seeds[name] = cfg
    qwen2 = dict(seeds["qwen1.5-moe-a2.7b"])
    seeds["qwen2-moe-dense-first"] = dict(qwen2, mlp_only_layers=[0], decoder_sparse_step=2)
    seeds["hf-style-qwen2"] = {
        "architectures": ["Qwen2ForCausalLM"],
        "_name_or_path": "Qwen/Qwen2-0.5B",
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": SEED_LAYERS,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "use_cache": True,
    }
    seeds["multimodal-text-config"] = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": dict(MODEL_PRESETS["tiny"], num_hidden_layers=SEED_LAYERS),
        "vision_config": {"hidden_size": 32},
    }
    return seeds


SEEDS = _seed_configs()


def _field_values(rng: np.random.Generator, name: str) -> Any:
    if name == "model_type":
        return pick(rng, [*MODEL_TYPES, "mamba", "LLAMA", "gpt2", "llava", "", None, 1])
    if name in INT_FIELDS:
        return pick(
            rng,
            [0, 1, 2, 3, 4, 7, 64, 65, 256, 257, -1, 2**14, 2**20, 2**24 + 1, 2**31, 2**63,
             64.0, 64.5, "64", True, None, Raw("1e999"), Raw("9" * 40)],
        )  # fmt: skip
    if name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias"):
        return pick(rng, [True, False, "false", "true", 0, 1, None])
    if name == "hidden_act":
        return pick(rng, ["silu", "swish", "gelu", "SiLU", "", None, 1])
    if name == "mlp_only_layers":
        return pick(rng, [[], [0], [1], [0, 1], [2], [-1], [True], ["0"], 0, None, [0.0]])
    if name == "text_config":
        return pick(rng, [dict(MODEL_PRESETS["tiny"], num_hidden_layers=1), {}, [], "x", None])
    return hostile_value(rng)


def generate(rng: np.random.Generator) -> EstimatorCase:
    name = pick(rng, list(SEEDS))
    doc: Any = SEEDS[name]
    parts = []
    arguments: dict[str, Any] = {}
    roll = rng.random()
    if roll < 0.75:
        for _ in range(int(rng.choice([1, 1, 1, 2, 3]))):
            doc, what = mutate_json(doc, rng, CONFIG_FIELDS, _field_values)
            parts.append(what)
    if roll >= 0.6:
        for _ in range(int(rng.choice([1, 1, 2]))):
            key = pick(rng, list(ARGUMENTS))
            arguments[key] = pick(rng, ARGUMENTS[key])
        parts.append(f"arguments {arguments}")
    text = dumps(doc).encode()
    if rng.random() < 0.1:
        text, what = mutate_json_text(text, rng)
        parts.append(what)
    # The whole estimate for one case in twenty, and wherever an argument only it reads is set.
    full = bool(rng.random() < 0.05) or bool({"framework", "context", "gpu"} & set(arguments))
    # Several GPUs, drawn last so that the cases recorded before keep every draw they made.
    if rng.random() < 0.1:
        several = {k: pick(rng, v) for k, v in SEVERAL_GPUS.items() if rng.random() < 0.6}
        if several:
            arguments.update(several)
            parts.append(f"several GPUs {several}")
            full = True
    return EstimatorCase(text, arguments, full, f"{name}: {'; '.join(parts) or 'unchanged'}")


class Runner:
    """Writes each case's config.json in a scratch directory and reads it back."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "config.json"

    def attempt(self, case: EstimatorCase) -> TrainingSetup | MemoryEstimate:
        self.path.with_suffix(".next").write_bytes(case.config)
        os.replace(self.path.with_suffix(".next"), self.path)
        case.path = self.path
        setup = TrainingSetup.create(self.path, **_setup_arguments(case.arguments))
        arch = setup.arch
        if (
            case.full
            and arch.num_layers <= MAX_FULL_LAYERS
            and arch.num_experts <= MAX_FULL_EXPERTS
        ):
            return nybble.estimate_memory(self.path, **case.arguments)
        return setup


def _setup_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments TrainingSetup.create takes (estimate_memory's others are checked when the
    whole estimate runs)."""
    whole_estimate_only = ("framework", "context", "gpu", *SEVERAL_GPUS)
    return {k: v for k, v in arguments.items() if k not in whole_estimate_only}


def _int_like(value: Any) -> bool:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return True
    return isinstance(value, int) and not isinstance(value, bool)


def verify(case: EstimatorCase, result: TrainingSetup | MemoryEstimate) -> str | None:
    ok, raw = strict_json_or_none(case.config)
    if not ok or not isinstance(raw, dict):
        return "accepted a config.json that is not a strict JSON object"
    cfg = raw
    if "text_config" in raw and "hidden_size" not in raw:
        if not isinstance(raw["text_config"], dict):
            return "accepted a text_config that is not an object"
        cfg = {**raw, **raw["text_config"]}
    setup = result.setup if isinstance(result, MemoryEstimate) else result
    arch = setup.arch
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        return f"accepted a model_type it does not model: {model_type!r}"
    if arch.model_type != model_type:
        return f"a field read otherwise: model_type {model_type!r} read as {arch.model_type!r}"
    heads = cfg["num_attention_heads"]
    expected = {
        "hidden_size": cfg.get("hidden_size"),
        "num_layers": cfg.get("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or heads,
        "vocab_size": cfg.get("vocab_size"),
        "head_dim": cfg.get("head_dim") or (cfg["hidden_size"] // heads if _int_like(heads) else 0),
    }
    for attr, want in expected.items():
        got = getattr(arch, attr)
        if not _int_like(want) or got != want or not 1 <= got:
            return f"a field read otherwise: {attr} read as {got!r}, the config has {want!r}"
    for flag in ("tie_word_embeddings",):
        want = cfg.get(flag)
        want = False if want is None else want
        if type(want) is not bool or getattr(arch, flag) != want:
            got = getattr(arch, flag)
            return f"a field read otherwise: {flag} read as {got!r}, the config has {want!r}"
    if cfg.get("hidden_act", "silu") not in ("silu", "swish", None):
        return f"accepted a hidden_act it does not model: {cfg.get('hidden_act')!r}"
    if arch.is_moe:
        experts_key = "num_local_experts" if cfg["model_type"] == "mixtral" else "num_experts"
        if arch.num_experts != cfg.get(experts_key):
            return f"a field read otherwise: num_experts {arch.num_experts} from {experts_key}"
        if arch.experts_per_token != cfg.get("num_experts_per_tok"):
            return "a field read otherwise: num_experts_per_tok"
    if isinstance(result, MemoryEstimate):
        parts = result.breakdown.values()
        if any(not isinstance(v, int) or v < 0 for v in parts) or sum(parts) != result.total_bytes:
            return (
                f"a breakdown that does not add up: {result.breakdown}, not to {result.total_bytes}"
            )
        if result.total_bytes <= 0:
            return f"a total that is not positive: {result.total_bytes}"
    return None


def test_the_seeds_estimate(tmp_path: Path) -> None:
    runner = Runner(tmp_path)
    for name, cfg in SEEDS.items():
        case = EstimatorCase(dumps(cfg).encode(), {}, True, name)
        result = runner.attempt(case)
        assert isinstance(result, MemoryEstimate)
        assert verify(case, result) is None, name


def test_the_generator_makes_cases_from_any_seed() -> None:
    check_generator("estimator", generate, 2000)


def test_fuzz_estimator_configs_and_arguments(tmp_path: Path) -> None:
    with scratch_directory(tmp_path) as scratch:
        runner = Runner(scratch)
        allowed = (*ARGUMENT_ERRORS, ReplayLimitError)  # a ValueError naming the bound
        suite = Suite("estimator", generate, runner.attempt, verify, allowed=allowed)
        suite.refused = _refused_as_promised
        tally = run_suite(suite, cases_for(0.2))
    check([tally])


def _refused_as_promised(case: EstimatorCase, error: BaseException) -> str | None:
    """A config file alone ends in a FormatError, or a ValueError where the run the arguments
    describe does not fit the model (a LoRA rank above a layer's width, more layers than the
    replay takes): never a TypeError or KeyError."""
    if case.arguments or type(error) in (*FILE_ERRORS, ValueError):
        return None
    return f"a bad config.json ended in {type(error).__name__}: {error}"
