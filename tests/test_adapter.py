"""LoraAdapter, AdamW, and PEFT adapter files (golden files written by PEFT, and live where
torch + peft are installed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nybble
from nybble import AdamW, LoraAdapter, LoraConfig, reference
from nybble.errors import FormatError

PEFT_FIXTURES = Path(__file__).parent / "fixtures" / "peft"
PEFT_CASES = sorted(p.name for p in PEFT_FIXTURES.iterdir() if p.is_dir())


def small_adapter(dora: bool = False, quantized: bool = False) -> LoraAdapter:
    rng = np.random.default_rng(0)
    adapter = LoraAdapter(
        LoraConfig(r=4, alpha=8, use_dora=dora, target_modules=("q_proj", "v_proj"))
    )
    for i in range(2):
        for proj, out in (("q_proj", 32), ("v_proj", 16)):
            w = rng.standard_normal((out, 24)).astype(np.float32)
            layer = adapter.add_layer(
                f"model.layers.{i}.self_attn.{proj}", nybble.quantize(w) if quantized else w
            )
            layer.set_lora_b(rng.standard_normal((out, 4)) * 0.1)
    return adapter


def test_adapter_layers_and_errors() -> None:
    adapter = small_adapter()
    assert len(adapter) == 4 and "model.layers.0.self_attn.q_proj" in adapter
    with pytest.raises(ValueError, match="already exists"):
        adapter.add_layer("model.layers.0.self_attn.q_proj", np.ones((4, 4), np.float32))
    with pytest.raises(KeyError, match="no layer named 'nope'"):
        adapter.forward_layer("nope", np.ones(24, np.float32))
    with pytest.raises(ValueError, match="dotted module path"):
        adapter.add_layer("a..b", np.ones((4, 4), np.float32))
    s = adapter.summary()
    assert s["layers"] == 4 and s["r"] == 4 and s["alpha"] == 8
    assert s["trainable"] == 2 * 4 * ((24 + 32) + (24 + 16))
    assert s["frozen"] == 2 * (32 * 24 + 16 * 24)
    assert s["ratio"] == pytest.approx(s["trainable"] / (s["trainable"] + s["frozen"]))


def test_merge_all_unmerge_all_and_merged_weights() -> None:
    adapter = small_adapter(dora=True)
    x = np.random.default_rng(1).standard_normal((3, 24)).astype(np.float32)
    name = "model.layers.1.self_attn.v_proj"
    before = adapter.forward_layer(name, x)
    weights = adapter.merged_weights()
    assert set(weights) == {f"{n}.weight" for n in adapter.layers}
    assert not any(layer.merged for layer in adapter.layers.values())
    adapter.merge_all()
    np.testing.assert_allclose(
        adapter[name].weight, weights[f"{name}.weight"], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(adapter.forward_layer(name, x), before, rtol=1e-4, atol=1e-5)
    adapter.unmerge_all()
    np.testing.assert_allclose(adapter.forward_layer(name, x), before, rtol=1e-4, atol=1e-5)


# --- AdamW ---------------------------------------------------------------------------------


def test_adamw_matches_the_oracle() -> None:
    rng = np.random.default_rng(0)
    p = {
        "a": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float32),
    }
    ref = {k: v.astype(np.float64) for k, v in p.items()}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v = {k: np.zeros_like(x) for k, x in ref.items()}
    opt = AdamW(p, lr=0.01, weight_decay=0.1)
    for t in range(1, 6):
        grads = {k: rng.standard_normal(x.shape).astype(np.float32) for k, x in p.items()}
        assert opt.step(grads)
        for k in p:
            ref[k], m[k], v[k] = reference.adamw_step(
                ref[k], grads[k].astype(np.float64), m[k], v[k], t, 0.01, weight_decay=0.1
            )
            np.testing.assert_allclose(p[k], ref[k], rtol=1e-5, atol=1e-6)
    assert opt.step_count == 5


def test_adamw_accumulation_averages_and_steps_every_n() -> None:
    rng = np.random.default_rng(1)
    p = {"w": np.ones(4, np.float32)}
    q = {"w": np.ones(4, np.float32)}
    acc = AdamW(p, lr=0.1, accumulation_steps=4)
    one = AdamW(q, lr=0.1)
    grads = [rng.standard_normal(4).astype(np.float32) for _ in range(4)]
    for g in grads[:3]:
        assert not acc.step({"w": g})
    assert acc.step_count == 0 and np.array_equal(p["w"], np.ones(4))
    assert acc.step({"w": grads[3]})
    one.step({"w": sum(grads) / 4})
    assert acc.step_count == 1
    np.testing.assert_allclose(p["w"], q["w"], rtol=1e-6)


def test_adamw_clips_by_global_norm_and_restores_state() -> None:
    p = {"a": np.zeros(3, np.float32), "b": np.zeros(1, np.float32)}
    opt = AdamW(p, lr=0.1, max_grad_norm=1.0)
    opt.step({"a": np.array([3.0, 0.0, 0.0], np.float32), "b": np.array([4.0], np.float32)})
    assert opt.last_grad_norm == pytest.approx(5.0)
    np.testing.assert_allclose(opt.m["a"], 0.1 * np.array([0.6, 0, 0]), rtol=1e-5)
    state = opt.state_dict()
    p2 = {k: v.copy() for k, v in p.items()}
    opt2 = AdamW(p2, lr=0.5)
    opt2.load_state_dict(state)
    g = {"a": np.ones(3, np.float32), "b": np.ones(1, np.float32)}
    opt.step(g)
    opt2.step(g)
    np.testing.assert_array_equal(p["a"], p2["a"])
    assert opt2.step_count == 2 and opt2.lr == 0.1


def test_adamw_errors() -> None:
    with pytest.raises(ValueError, match="accumulation_steps"):
        AdamW({}, accumulation_steps=0)
    opt = AdamW({"w": np.zeros(2, np.float32)})
    with pytest.raises(KeyError, match="unknown"):
        opt.step({"v": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="shape"):
        opt.step({"w": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="non-finite"):
        opt.step({"w": np.array([np.nan, 0], np.float32)})


def test_training_a_layer_reduces_the_loss() -> None:
    rng = np.random.default_rng(2)
    adapter = small_adapter()
    name = "model.layers.0.self_attn.q_proj"
    layer = adapter[name]
    x = rng.standard_normal((16, 24)).astype(np.float32)
    target = layer.forward(x) + rng.standard_normal((16, 32)).astype(np.float32)
    opt = AdamW(layer.parameters(), lr=0.02)
    losses = []
    for _ in range(60):
        y = layer.forward(x)
        losses.append(float(((y - target) ** 2).mean()))
        layer.backward(2 * (y - target) / y.size)
        opt.step(layer.gradients())
    assert losses[-1] < 0.7 * losses[0]


# --- PEFT files ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", PEFT_CASES)
def test_reads_adapters_written_by_peft(case: str) -> None:
    """Golden files from tests/fixtures/make_peft_fixtures.py: nybble's outputs equal PEFT's."""
    d = PEFT_FIXTURES / case
    expected = np.load(d / "expected.npz")
    base = {k: expected[k] for k in expected.files if k.endswith(".weight")}
    adapter = LoraAdapter.from_pretrained(d, base).eval()
    assert {f"{n}.weight" for n in adapter.layers} == set(base)
    for name in adapter.layers:
        np.testing.assert_allclose(
            adapter.forward_layer(name, expected[f"{name}.x"]),
            expected[f"{name}.y"],
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize("case", PEFT_CASES)
def test_reads_peft_adapters_over_an_nf4_base(case: str) -> None:
    d = PEFT_FIXTURES / case
    expected = np.load(d / "expected.npz")
    base = {k: nybble.quantize(expected[k]) for k in expected.files if k.endswith(".weight")}
    adapter = LoraAdapter.from_pretrained(d, base).eval()
    for name, layer in adapter.layers.items():
        assert isinstance(layer, nybble.QLoraLinear)
        dense = nybble.LoraLinear(layer.dequantize_weight(), layer.config).eval()
        for attr in ("lora_a", "lora_b"):
            getattr(dense, attr)[...] = getattr(layer, attr)
        if layer.lora_magnitude is not None:
            dense.set_lora_magnitude(layer.lora_magnitude)
        x = expected[f"{name}.x"]
        np.testing.assert_allclose(layer.forward(x), dense.forward(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dora", [False, True])
def test_save_pretrained_round_trip_and_file_format(tmp_path: Path, dora: bool) -> None:
    adapter = small_adapter(dora=dora)
    adapter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["use_dora"] is dora and config["target_modules"] == ["q_proj", "v_proj"]
    for field in (
        "lora_dropout",
        "use_rslora",
        "fan_in_fan_out",
        "bias",
        "base_model_name_or_path",
    ):
        assert field in config
    with nybble.safetensors_io.SafeTensorsFile(tmp_path / "adapter_model.safetensors") as f:
        assert f.metadata == {"format": "pt"}
        keys = set(f.keys())
        assert f.shape("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") == (4, 24)
        assert f.shape("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight") == (32, 4)
    per_layer = 3 if dora else 2
    assert len(keys) == 4 * per_layer
    base = {f"{n}.weight": layer.weight for n, layer in adapter.layers.items()}
    back = LoraAdapter.from_pretrained(tmp_path, base)
    x = np.random.default_rng(3).standard_normal((2, 24)).astype(np.float32)
    for name in adapter.layers:
        np.testing.assert_array_equal(back.forward_layer(name, x), adapter.forward_layer(name, x))


def test_from_pretrained_reports_problems(tmp_path: Path) -> None:
    adapter = small_adapter()
    adapter.save_pretrained(tmp_path)
    missing = r"base has no 'model\.layers\.0\.self_attn\.q_proj\.weight'"
    with pytest.raises(KeyError, match=missing):
        LoraAdapter.from_pretrained(tmp_path, {})
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(cfg, peft_type="IA3")))
    with pytest.raises(FormatError, match="peft_type must be 'LORA'"):
        LoraAdapter.from_pretrained(tmp_path, {})
    (tmp_path / "adapter_config.json").write_text("{")
    with pytest.raises(FormatError, match="not valid JSON"):
        LoraAdapter.from_pretrained(tmp_path, {})
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(FormatError, match="header length"):
        LoraAdapter.from_pretrained(tmp_path, {})
    with pytest.raises(ValueError, match="no layers"):
        LoraAdapter(LoraConfig()).save_pretrained(tmp_path / "empty")


# --- live PEFT (where torch + transformers + peft are installed) ------------------------------


def _tiny_llama() -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("dora", [False, True])
def test_live_peft_loads_what_nybble_writes(tmp_path: Path, dora: bool) -> None:
    model = _tiny_llama()
    import torch
    from peft import PeftModel

    targets = ("q_proj", "v_proj", "down_proj")
    adapter = LoraAdapter(LoraConfig(r=4, alpha=8, use_dora=dora, target_modules=targets))
    rng = np.random.default_rng(0)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets:
            layer = adapter.add_layer(name, module.weight.detach().numpy())
            layer.set_lora_b(rng.standard_normal(layer.lora_b.shape) * 0.1)
            if dora:
                layer.set_lora_magnitude(
                    layer.lora_magnitude * rng.uniform(0.5, 1.5, layer.out_features)
                )
    adapter.save_pretrained(tmp_path)
    peft_model = PeftModel.from_pretrained(model, tmp_path, adapter_name="nybble")
    result = peft_model.load_adapter(tmp_path, adapter_name="again")
    assert [k for k in result.missing_keys if "lora_" in k and ".again." in k] == []
    peft_model.set_adapter("nybble")
    modules = dict(peft_model.base_model.model.named_modules())
    for name in adapter.layers:
        x = rng.standard_normal((3, adapter[name].in_features)).astype(np.float32)
        with torch.no_grad():
            want = modules[name](torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(
            adapter.eval().forward_layer(name, x), want, rtol=1e-5, atol=1e-6
        )
