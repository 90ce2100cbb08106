"""The estimator reads what it is given (issues 16 and 19): config fields checked by type and
range with the field named, models it does not understand refused, mixtures of experts
counted, limits that end at once, the GPU given in Python as on the command line."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from nybble.errors import FormatError
from nybble.memory import (
    BREAKDOWN_KEYS,
    MODEL_PRESETS,
    TrainingSetup,
    estimate_memory,
    resolve_gpu,
    resolve_model,
)
from nybble.memory.arch import MAX_CONFIG_BYTES
from nybble.memory.presets import GiB, MiB

TINY = MODEL_PRESETS["tiny"]


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tie_word_embeddings", "false"),
        ("tie_word_embeddings", 1),
        ("attention_bias", "no"),
        ("num_attention_heads", 0),
        ("num_attention_heads", -4),
        ("hidden_size", 1.5),
        ("hidden_size", "64"),
        ("vocab_size", 10**40),
        ("num_hidden_layers", True),
        ("num_key_value_heads", 3),
        ("model_type", "mamba"),
        ("model_type", 7),
        ("hidden_act", "gelu"),
        ("intermediate_size", None),
    ],
)
def test_bad_fields_are_format_errors_naming_the_field(field: str, value: Any) -> None:
    cfg = dict(TINY, **{field: value})
    if value is None:
        del cfg[field]
    with pytest.raises(FormatError) as e:
        resolve_model(cfg)
    assert e.value.field == field


@pytest.mark.parametrize(
    "text",
    [
        '{"hidden_size": Infinity}',
        '{"hidden_size": NaN}',
        '{"hidden_size": ' + "9" * 400 + "}",
        "[" * 100_000 + "]" * 100_000,
        "not json",
        "\xff\xfe",
        "[1, 2]",
    ],
)
def test_malformed_json_is_a_format_error_naming_the_file(tmp_path: Path, text: str) -> None:
    path = _config(tmp_path, text)
    with pytest.raises(FormatError) as e:
        estimate_memory(str(path))
    assert e.value.source == str(path)


def test_config_files_are_bounded_and_regular(tmp_path: Path) -> None:
    big = _config(tmp_path, " " * (MAX_CONFIG_BYTES + 1) + json.dumps(TINY))
    with pytest.raises(FormatError):
        estimate_memory(big)
    for special in ("/dev/zero", "/dev/null"):
        t0 = time.monotonic()
        with pytest.raises(FormatError) as e:
            estimate_memory(special)
        assert e.value.source == special and time.monotonic() - t0 < 1


def test_a_json_integer_float_is_read() -> None:
    assert resolve_model(dict(TINY, hidden_size=64.0)).hidden_size == 64


def test_deep_models_are_refused_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="num_hidden_layers"):
        estimate_memory(dict(TINY, num_hidden_layers=10_000))
    assert time.monotonic() - t0 < 1


def test_absurd_sizes_are_a_clear_value_error() -> None:
    for kwargs in (dict(batch=10**9), dict(seq_len=10**9), dict(lora_r=10**9)):
        with pytest.raises(ValueError) as e:
            estimate_memory("tiny", **kwargs)  # type: ignore[arg-type]
        assert type(e.value) is ValueError
    # the largest sizes the fields allow: a clear result, which fits no GPU
    huge = dict(TINY, vocab_size=1 << 24, hidden_size=1 << 20, num_attention_heads=1 << 10)
    est = estimate_memory(dict(huge, intermediate_size=64), seq_len=1 << 20)
    assert est.total_bytes > 1 << 45 and not est.fits("h200")


# --- mixtures of experts ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("mixtral-8x7b", 46_702_792_704),
        ("qwen3-30b-a3b", 30_532_122_624),
        ("qwen1.5-moe-a2.7b", 14_315_784_192),
    ],
)
def test_moe_parameter_counts(name: str, params: int) -> None:
    assert resolve_model(name).num_parameters == params


def test_moe_lora_targets_are_what_all_linear_finds() -> None:
    """transformers 5 fuses the experts into 3-D parameters. PEFT 0.21's all-linear adapts the
    attention (and a shared expert with its gate), and for Mixtral and Qwen3-MoE also the
    router, gate_up_proj (at twice the rank) and down_proj through lora.ParamWrapper; Qwen2-MoE
    keeps its experts without an adapter. A list of names adapts only those linear layers."""
    mixtral = TrainingSetup.create("mixtral-8x7b")
    assert mixtral.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert mixtral.expert_targets == ("router", "gate_up_proj", "down_proj")
    attention = 32 * 16 * ((4096 + 4096) * 2 + (1024 + 4096) * 2)
    assert mixtral.arch.lora_parameters(16, mixtral.targets) == attention
    router = 16 * (4096 + 8)
    gate_up = 32 * 8 * (4096 + 2 * 14336)
    down = 16 * 8 * (14336 + 4096)
    assert mixtral.lora_parameters == attention + 32 * (router + gate_up + down)
    assert TrainingSetup.create("mixtral-8x7b", targets="q_proj,v_proj").expert_targets == ()
    qwen2 = TrainingSetup.create("qwen1.5-moe-a2.7b")
    assert qwen2.expert_targets == () and "shared_expert_gate" in qwen2.targets
    assert qwen2.arch.linear_shapes(0)["shared_expert_gate"] == (1, 2048)
    assert qwen2.arch.linear_shapes(0)["gate_proj"] == (5632, 2048)
    assert TrainingSetup.create("qwen3-30b-a3b").expert_targets == mixtral.expert_targets


def test_qwen3_moe_dense_layers_keep_no_mlp_adapter() -> None:
    """PEFT maps the MLP names of all-linear to the fused parameters: the MLP of a layer in
    mlp_only_layers gets no adapter."""
    cfg = dict(MODEL_PRESETS["qwen3-30b-a3b"], num_hidden_layers=2)
    sparse = TrainingSetup.create(cfg)
    mixed = TrainingSetup.create(dict(cfg, mlp_only_layers=[0]))
    assert mixed.targets == sparse.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert mixed.layer_lora_tensors(0) == sparse.layer_lora_tensors(0)[:8]
    assert mixed.layer_lora_tensors(1) == sparse.layer_lora_tensors(1)


def test_moe_expert_adapters_refuse_dropout() -> None:
    with pytest.raises(ValueError):
        TrainingSetup.create("mixtral-8x7b", lora_dropout=0.1)
    assert TrainingSetup.create("mixtral-8x7b", lora_dropout=0.1, targets="q_proj").lora_dropout
    assert TrainingSetup.create("qwen1.5-moe-a2.7b", lora_dropout=0.1).lora_dropout == 0.1


def test_adapted_experts_keep_the_whole_stack_for_backward() -> None:
    """With an adapter on the experts, PEFT makes W + B A of each fused weight for the forward
    and the grouped matmul keeps it: without checkpointing every layer holds a copy of its
    experts until backward."""
    cfg = dict(MODEL_PRESETS["mixtral-8x7b"], num_hidden_layers=2, vocab_size=1024)
    cfg.update(hidden_size=512, intermediate_size=1024, num_attention_heads=8)
    cfg.update(num_key_value_heads=2)
    full = estimate_memory(cfg, seq_len=256, grad_checkpointing=False)
    attn = estimate_memory(cfg, seq_len=256, grad_checkpointing=False, targets="q_proj,k_proj")
    stack = 4 * 8 * 3 * 512 * 1024  # gate_up_proj and down_proj, float32
    # at the loss every layer's forward has run and none of its backward
    assert full.phases["loss"] - attn.phases["loss"] >= 2 * stack
    checkpointed = estimate_memory(cfg, seq_len=256)
    assert checkpointed.phases["loss"] < full.phases["loss"] - 2 * stack


def test_moe_experts_are_unquantized_float32_weights() -> None:
    small = dict(MODEL_PRESETS["qwen3-30b-a3b"], num_hidden_layers=2, num_experts=8)
    est = estimate_memory(small, seq_len=128)
    experts = 2 * 8 * 3 * 2048 * 768
    assert est.breakdown["unquantized_weights"] >= 4 * experts
    assert sum(est.breakdown.values()) == est.total_bytes
    dense = estimate_memory(dict(small, mlp_only_layers=[0, 1]), seq_len=128)
    assert dense.breakdown["unquantized_weights"] < est.breakdown["unquantized_weights"] - 4 * (
        experts - 1
    )


def test_moe_activations_grow_with_experts_per_token() -> None:
    base = dict(MODEL_PRESETS["mixtral-8x7b"], num_hidden_layers=2, vocab_size=1024)
    one = estimate_memory(dict(base, num_experts_per_tok=1), seq_len=512, grad_checkpointing=False)
    two = estimate_memory(dict(base, num_experts_per_tok=2), seq_len=512, grad_checkpointing=False)
    assert two.breakdown["activations"] > one.breakdown["activations"]


def test_moe_fields_are_checked() -> None:
    base = MODEL_PRESETS["qwen3-30b-a3b"]
    for field, value in (
        ("num_experts_per_tok", 500),
        ("mlp_only_layers", "all"),
        ("mlp_only_layers", [99]),
        ("num_experts", 0),
    ):
        with pytest.raises(FormatError) as e:
            resolve_model(dict(base, **{field: value}))
        assert e.value.field == field


# --- the GPU, the loops, the margin -----------------------------------------------------


def test_gpu_in_python_as_on_the_command_line() -> None:
    est = estimate_memory("tiny", seq_len=64, gpu="rtx4090")
    assert est.fits() and est.headroom() == est.gpu_bytes() - est.required_bytes
    assert est.gpu is not None and est.gpu.name == "rtx4090"
    d = est.to_dict()["gpu"]
    assert d["fits"] is True and d["bytes"] == resolve_gpu("RTX 4090").total_bytes
    with pytest.raises(ValueError):
        estimate_memory("tiny", seq_len=64).fits()


def test_gpu_table_covers_8_to_80_gb_cards() -> None:
    from nybble.memory import GPUS

    sizes = sorted(spec.total_bytes for spec in GPUS.values())
    assert sizes[0] <= 8 * GiB and sizes[-1] >= 80 * GiB
    for name in ("t4", "l4", "a10g", "a100-40g", "a100-80g", "h100-80g", "rtx3090", "rtx4090"):
        assert name in GPUS


def test_the_benchmark_loop_keeps_the_kv_cache_without_checkpointing() -> None:
    cfg = dict(MODEL_PRESETS["llama-3.2-1b"], num_hidden_layers=4)
    plain = estimate_memory(cfg, seq_len=1024, grad_checkpointing=False)
    bench = estimate_memory(cfg, seq_len=1024, grad_checkpointing=False, loop="benchmark")
    assert plain.setup.loop == "plain" and bench.setup.loop == "benchmark"
    assert plain.allocated_peak_bytes != bench.allocated_peak_bytes
    with pytest.raises(ValueError, match="loop"):
        estimate_memory(cfg, loop="trainer")


def test_steady_state_and_margin() -> None:
    est = estimate_memory("llama-3.2-1b", seq_len=512)
    steps = est.step_reserved_bytes
    assert len(steps) >= 4  # the setup and at least 3 steps
    assert steps == sorted(steps) and steps[-1] == est.reserved_peak_bytes
    # 1% of the reserved peak in whole 2 MiB, at least 20 MiB
    assert est.margin_bytes % (2 * MiB) == 0
    assert (
        est.reserved_peak_bytes // 100
        <= est.margin_bytes
        < est.reserved_peak_bytes // 100 + 2 * MiB
    )
    assert estimate_memory("tiny", seq_len=64).margin_bytes == 20 * MiB


def test_context_given_in_python() -> None:
    base = estimate_memory("tiny", seq_len=64)
    given = estimate_memory("tiny", seq_len=64, context="1GiB")
    assert given.context_bytes == GiB and given.context_source == "given"
    assert given.total_bytes - base.total_bytes == GiB - base.context_bytes
    assert tuple(given.breakdown) == BREAKDOWN_KEYS
    with pytest.raises(ValueError):
        estimate_memory("tiny", context="rtx4090")


def test_suggestions_fit_and_come_smallest_first() -> None:
    est = estimate_memory("qwen3-0.6b", seq_len=2048, grad_checkpointing=False)
    gpu = "rtx4060"
    assert not est.fits(gpu)
    found = est.suggestions(gpu)
    assert found and all(x.required_bytes <= resolve_gpu(gpu).total_bytes for x in found)
    assert found[0].setting == "grad_checkpointing"
    assert estimate_memory("tiny", seq_len=64).suggestions("80GB") == []


# --- arguments of the wrong type (issue 39): a ValueError naming the argument ---------------


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("targets", None),
        ("targets", 5),
        ("targets", b"q_proj"),
        ("targets", {"q_proj": 1}),
        ("targets", [None]),
        ("double_quant", "no"),  # read by its truth, "no" was True
        ("double_quant", None),
        ("double_quant", 1),
        ("grad_checkpointing", "false"),
        ("grad_checkpointing", 0),
        ("lora_dtype", None),  # read as "none", a bfloat16 alias
        ("compute_dtype", None),
        ("quant", 4),
        ("quant", ["nf4"]),
        ("blocksize", "64"),
        ("batch", 2.0),
        ("seq_len", "128"),
        ("lora_r", None),
    ],
)
def test_arguments_of_the_wrong_type_are_value_errors_naming_them(
    argument: str, value: Any
) -> None:
    arguments: dict[str, Any] = dict(seq_len=128)
    arguments[argument] = value
    with pytest.raises(ValueError, match=argument):
        estimate_memory("tiny", **arguments)


def test_numpy_scalars_are_the_numbers_they_hold() -> None:
    np = pytest.importorskip("numpy")
    plain = estimate_memory("tiny", batch=2, seq_len=128, lora_r=8, double_quant=False)
    numpy = estimate_memory(
        "tiny",
        batch=np.int64(2),
        seq_len=np.int32(128),
        lora_r=np.uint8(8),
        blocksize=np.int64(64),
        double_quant=np.bool_(False),
    )
    assert numpy.total_bytes == plain.total_bytes and numpy.setup == plain.setup


@pytest.mark.parametrize("seq_lens", [None, 5, "128", b"12"])
def test_sweep_takes_a_list_of_lengths(seq_lens: Any) -> None:
    with pytest.raises(ValueError, match="seq_lens"):
        estimate_memory("tiny", seq_len=128).sweep_seq_len(seq_lens)


def test_a_nul_in_the_model_name_is_named() -> None:
    with pytest.raises(ValueError, match="model"):
        estimate_memory("qwen3\0-4b")
