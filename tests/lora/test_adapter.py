"""LoraAdapter, AdamW, and PEFT adapter files (golden files written by PEFT, and live where
torch + peft are installed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import nybble
from nybble import AdamW, LoraAdapter, LoraConfig, reference
from nybble.errors import FormatError
from tests import FIXTURES

PEFT_FIXTURES = FIXTURES / "peft"
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
        assert f.metadata["format"] == "pt"
        assert set(f.metadata) == {"format", "nybble.adapter_config_sha256"}
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


EXTRAS = FIXTURES / "peft_extras"
EXTRA_CASES = sorted(p.name for p in EXTRAS.iterdir() if p.is_dir())


def _file_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    with nybble.safetensors_io.SafeTensorsFile(path) as f:
        return {k: (f.dtype_name(k), f.shape(k), f.raw(k).tobytes()) for k in f.keys()}


@pytest.mark.parametrize("case", EXTRA_CASES)
def test_extra_tensors_peft_saves_are_kept_and_saved_back_unchanged(
    tmp_path: Path, case: str
) -> None:
    """Adapters PEFT 0.21 wrote with modules_to_save and trainable_token_indices
    (tests/fixtures/peft_extras/): loaded with their extra tensors in `extra_tensors`, keyed
    as in the file, and the fields naming them; saved back tensor for tensor, byte for byte,
    with the same fields; loaded again alike."""
    d = EXTRAS / case
    adapter = LoraAdapter.from_pretrained(d, d / "base")
    stored = _file_tensors(d / "adapter_model.safetensors")
    extra = {k for k in stored if ".lora_" not in k}
    assert extra and set(adapter.extra_tensors) == extra
    for key in extra:
        got = adapter.extra_tensors[key]
        assert (nybble.safetensors_io.dtype_code(got.dtype), got.shape) == stored[key][:2]
        assert got.tobytes() == stored[key][2]
    config = json.loads((d / "adapter_config.json").read_text())
    assert adapter.modules_to_save == config["modules_to_save"]
    assert adapter.trainable_token_indices == config["trainable_token_indices"]
    adapter.save_pretrained(tmp_path / "saved")
    saved = _file_tensors(tmp_path / "saved" / "adapter_model.safetensors")
    assert {k: saved[k] for k in extra} == {k: stored[k] for k in extra}
    assert set(saved) == set(stored)
    written = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    for field in ("modules_to_save", "trainable_token_indices"):
        assert written[field] == config[field]
    again = LoraAdapter.from_pretrained(tmp_path / "saved", d / "base")
    assert {k: v.tobytes() for k, v in again.extra_tensors.items()} == {
        k: v.tobytes() for k, v in adapter.extra_tensors.items()
    }
    # kept in their own dtype (PEFT saves a bf16 model's copies in bf16)
    adapter.extra_tensors = {
        k: v.astype(ml_dtypes.bfloat16) for k, v in adapter.extra_tensors.items()
    }
    adapter.save_pretrained(tmp_path / "bf16")
    back = LoraAdapter.from_pretrained(tmp_path / "bf16", d / "base")
    assert all(v.dtype == ml_dtypes.bfloat16 for v in back.extra_tensors.values())


def test_extra_tensors_the_config_does_not_name_are_refused(tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "a"
    shutil.copytree(EXTRAS / "trainable_tokens", d)
    tokens = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    cases: list[tuple[dict[str, Any], dict[str, np.ndarray], str]] = [
        ({}, {"base_model.model.model.norm.weight": np.ones(8, np.float32)}, "norm"),
        ({"trainable_token_indices": [1, 5]}, {}, tokens),  # 3 rows for 2 ids
        ({"trainable_token_indices": {"lm_head": [1, 5, 7]}}, {}, tokens),  # another module
        ({"trainable_token_indices": None}, {}, tokens),
        ({}, {tokens: np.ones((3, 8), np.int32)}, tokens),
        ({}, {"base_model.model.model.layers.0.mlp.lora_C.weight": np.ones(2)}, "lora_C"),
    ]
    config = json.loads((d / "adapter_config.json").read_text())
    weights = (d / "adapter_model.safetensors").read_bytes()
    for changes, tensors, key in cases:
        (d / "adapter_config.json").write_text(json.dumps({**config, **changes}))
        (d / "adapter_model.safetensors").write_bytes(weights)
        _rewrite_weights(d, lambda t, tensors=tensors: {**t, **tensors})
        e = _refused(d, {})
        assert e.field is not None and key in e.field, (changes, e)
    # save_pretrained refuses what PEFT would not load back
    adapter = small_adapter()
    adapter.extra_tensors = {"base_model.model.model.norm.weight": np.ones(4, np.float32)}
    with pytest.raises(ValueError, match="extra_tensors"):
        adapter.save_pretrained(tmp_path / "b")
    assert not (tmp_path / "b").exists()
    adapter.modules_to_save = ["norm"]
    adapter.save_pretrained(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "adapter_config.json").read_text())["modules_to_save"] == [
        "norm"
    ]


def _refused(directory: Path, base: dict[str, Any] | None = None) -> FormatError:
    with pytest.raises(FormatError) as e:
        LoraAdapter.from_pretrained(directory, base or {})
    return e.value


def test_from_pretrained_reports_problems(tmp_path: Path) -> None:
    adapter = small_adapter()
    adapter.save_pretrained(tmp_path)
    with pytest.raises(KeyError) as missing:
        LoraAdapter.from_pretrained(tmp_path, {})
    assert "model.layers.0.self_attn.q_proj.weight" in str(missing.value)
    config_path = tmp_path / "adapter_config.json"
    cfg = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(dict(cfg, peft_type="IA3")))
    e = _refused(tmp_path)
    assert (e.source, e.field) == (str(config_path), "peft_type")
    config_path.write_text("{")
    assert _refused(tmp_path).source == str(config_path)
    config_path.write_text(json.dumps(cfg))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    assert _refused(tmp_path).source == str(tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="no layers"):
        LoraAdapter(LoraConfig()).save_pretrained(tmp_path / "empty")


@pytest.mark.parametrize(
    "field, value",
    [
        ("r", "8"),
        ("r", 0),
        ("r", 10**40),
        ("lora_alpha", "16"),
        ("lora_alpha", 1e308),
        ("lora_alpha", -1),
        ("lora_dropout", 1.5),
        ("use_rslora", "no"),
        ("use_dora", 1),
        ("fan_in_fan_out", "false"),
        ("target_modules", [1, 2]),
        ("target_modules", "q_proj("),
        ("alpha_pattern", {"q_proj(": 4}),
        ("alpha_pattern", {"q_proj": "4"}),
        ("rank_pattern", {"q_proj": 2.5}),
        ("init_lora_weights", "pissa"),
        ("bias", "all"),
        ("modules_to_save", "lm_head"),
        ("modules_to_save", [""]),
        ("modules_to_save", [1]),
        ("trainable_token_indices", [-1]),
        ("trainable_token_indices", [1.5]),
        ("trainable_token_indices", {"embed_tokens": [True]}),
        ("trainable_token_indices", "1,2"),
    ],
)
def test_config_fields_are_checked_by_type_and_range(
    tmp_path: Path, field: str, value: Any
) -> None:
    small_adapter().save_pretrained(tmp_path)
    config_path = tmp_path / "adapter_config.json"
    cfg = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(dict(cfg, **{field: value})))
    e = _refused(tmp_path)
    assert e.source == str(config_path) and e.field == field


def test_config_without_r_and_with_bad_json_numbers(tmp_path: Path) -> None:
    small_adapter().save_pretrained(tmp_path)
    config_path = tmp_path / "adapter_config.json"
    cfg = json.loads(config_path.read_text())
    del cfg["r"]
    config_path.write_text(json.dumps(cfg))
    assert _refused(tmp_path).field == "r"
    config_path.write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": Infinity}')
    assert _refused(tmp_path).field is None
    config_path.write_text("[" * 100_000 + "]" * 100_000)
    assert _refused(tmp_path).source == str(config_path)


def _rewrite_weights(directory: Path, change: Any) -> None:
    path = directory / "adapter_model.safetensors"
    tensors = dict(nybble.safetensors_io.load(path))
    nybble.safetensors_io.save(change(tensors), path, metadata={"format": "pt"})


def test_weights_that_hold_nothing_or_odd_shapes_are_refused(tmp_path: Path) -> None:
    adapter = small_adapter()
    base = {f"{n}.weight": layer.weight for n, layer in adapter.layers.items()}
    adapter.save_pretrained(tmp_path)
    _rewrite_weights(tmp_path, lambda t: {})
    assert _refused(tmp_path, base).problem == "holds no LoRA tensors"
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    for bad in (np.float32(1.0), np.ones(4, np.float32), np.ones((3, 24), np.float32)):
        adapter.save_pretrained(tmp_path)
        _rewrite_weights(tmp_path, lambda t, bad=bad: dict(t, **{key: np.asarray(bad)}))
        assert _refused(tmp_path, base).field == key


def test_an_interrupted_save_is_refused_not_loaded(tmp_path: Path) -> None:
    """Weights of one save beside the config of another (what a kill between the two renames
    leaves) are refused; each save alone loads."""
    first, second = small_adapter(), small_adapter()
    second.config = second.config.with_(alpha=2.0)
    base = {f"{n}.weight": layer.weight for n, layer in first.layers.items()}
    first.save_pretrained(tmp_path / "a")
    second.save_pretrained(tmp_path / "b")
    for d in ("a", "b"):
        LoraAdapter.from_pretrained(tmp_path / d, base)
    (tmp_path / "a" / "adapter_model.safetensors").replace(
        tmp_path / "b" / "adapter_model.safetensors"
    )
    e = _refused(tmp_path / "b", base)
    assert e.source == str(tmp_path / "b" / "adapter_config.json")


def test_a_pending_save_is_the_adapter_until_moved_in(tmp_path: Path) -> None:
    """The states a save over an existing adapter passes through (the kill tests reach them
    by SIGKILL, tests/files/test_kill_writers.py): the new files committed in `PENDING`, then moved
    in one by one. Each loads as the new adapter; a pending config that the weights beside it
    do not record (other weights written since, by another tool) is stale and ignored."""
    from nybble.lora.adapter import PENDING

    old, new = small_adapter(), small_adapter()
    new.config = new.config.with_(alpha=2.0)
    base = {f"{n}.weight": layer.weight for n, layer in old.layers.items()}
    weights, config = "adapter_model.safetensors", "adapter_config.json"

    def state(moved: tuple[str, ...]) -> Path:
        d = tmp_path / f"moved-{len(moved)}"
        old.save_pretrained(d)
        new.save_pretrained(tmp_path / "new")
        (tmp_path / "new").rename(d / PENDING)
        for name in moved:
            (d / PENDING / name).replace(d / name)
        return d

    for moved in ((), (weights,), (weights, config)):
        d = state(moved)
        assert LoraAdapter.from_pretrained(d, base).config.alpha == 2.0, moved
        old.save_pretrained(d)  # finishes the pending save first, then saves
        assert sorted(p.name for p in d.iterdir()) == [config, weights]
        assert LoraAdapter.from_pretrained(d, base).config.alpha == old.config.alpha
    # Stale: the weights were rewritten by another tool (no digest) after a kill.
    d = state((weights,))
    foreign = dict(nybble.safetensors_io.load(d / weights))
    nybble.safetensors_io.save(foreign, d / weights, {"format": "pt"})
    assert LoraAdapter.from_pretrained(d, base).config.alpha == old.config.alpha
    old.save_pretrained(d)
    assert sorted(p.name for p in d.iterdir()) == [config, weights]


def test_saves_keep_the_umask_and_leave_no_temporaries(tmp_path: Path) -> None:
    import os

    old = os.umask(0o027)
    try:
        small_adapter().save_pretrained(tmp_path / "new")
        small_adapter().save_pretrained(tmp_path / "new")  # over an existing directory
    finally:
        os.umask(old)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "new" / name).stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["new"]


def test_a_failed_save_changes_nothing(tmp_path: Path) -> None:
    adapter = small_adapter()
    adapter.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    adapter.base_model_name_or_path = object()  # type: ignore[assignment]
    with pytest.raises(TypeError):
        adapter.save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_path_objects_and_names_with_or_without_weight(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 12)).astype(np.float32)
    adapter = LoraAdapter(LoraConfig(r=2, target_modules=["q_proj"]), tmp_path / "base")
    adapter.add_layer("model.layers.0.self_attn.q_proj.weight", w)
    assert "model.layers.0.self_attn.q_proj" in adapter
    with pytest.raises(ValueError, match="target_modules"):
        adapter.add_layer("model.layers.0.mlp.up_proj", w)
    adapter.save_pretrained(tmp_path / "out")
    for key in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj.weight"):
        back = LoraAdapter.from_pretrained(tmp_path / "out", {key: w})
        assert back.base_model_name_or_path == str(tmp_path / "base")


# --- live PEFT (where torch + transformers + peft are installed) ------------------------------


def _tiny_llama() -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
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


@pytest.mark.parametrize("case", EXTRA_CASES)
def test_live_peft_merges_what_nybble_saves_with_extra_tensors(tmp_path: Path, case: str) -> None:
    """PEFT loads an adapter nybble saved back (modules_to_save, trainable tokens) and merges
    it to exactly what it merges from its own files."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    d = EXTRAS / case
    LoraAdapter.from_pretrained(d, d / "base").save_pretrained(tmp_path)
    merged = []
    for adapter_dir in (d, tmp_path):
        model = transformers.LlamaForCausalLM.from_pretrained(d / "base")
        peft_model = peft.PeftModel.from_pretrained(model, adapter_dir)
        merged.append(peft_model.merge_and_unload().state_dict())
    assert set(merged[0]) == set(merged[1])
    assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])


# --- PEFT's behaviour around loading (issue 19) -------------------------------------------------


def _checkpoint_dir(path: Path, adapter: LoraAdapter) -> dict[str, np.ndarray]:
    """A Hugging Face-shaped checkpoint directory holding the adapter's base weights."""
    weights = {
        f"{n}.weight": np.ascontiguousarray(layer.weight) for n, layer in adapter.layers.items()
    }
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    nybble.safetensors_io.save(weights, path / "model.safetensors", metadata={"format": "pt"})
    return weights


@pytest.mark.parametrize("layout", ["dense", "nybble", "bnb"])
def test_from_pretrained_reads_the_base_from_a_checkpoint_directory(
    tmp_path: Path, layout: str
) -> None:
    adapter = small_adapter()
    adapter.save_pretrained(tmp_path / "adapter")
    weights = _checkpoint_dir(tmp_path / "model", adapter)
    base_dir = tmp_path / "model"
    if layout != "dense":
        from nybble.checkpoint import quantize_checkpoint

        base_dir = tmp_path / f"model-{layout}"
        quantize_checkpoint(tmp_path / "model", base_dir, layout=layout, targets=["*_proj"])
    back = LoraAdapter.from_pretrained(tmp_path / "adapter", base_dir)
    bases = {k: v if layout == "dense" else nybble.quantize(v) for k, v in weights.items()}
    want = LoraAdapter.from_pretrained(tmp_path / "adapter", bases)
    x = np.random.default_rng(3).standard_normal((2, 24)).astype(np.float32)
    for name in adapter.layers:
        got = back.forward_layer(name, x)
        np.testing.assert_allclose(got, want.forward_layer(name, x), rtol=1e-5, atol=1e-6)
        assert isinstance(back[name], nybble.QLoraLinear) == (layout != "dense")
    with pytest.raises(FormatError) as e:
        LoraAdapter.from_pretrained(tmp_path / "adapter", tmp_path / "adapter")
    assert e.value.source == str(tmp_path / "adapter")


def test_from_pretrained_is_in_eval_mode_unless_trainable(tmp_path: Path) -> None:
    """As PEFT: a loaded adapter has no dropout unless it is loaded to be trained."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 24)).astype(np.float32)
    adapter = LoraAdapter(LoraConfig(r=2, lora_dropout=0.5, target_modules=["q_proj"]))
    adapter.add_layer("m.q_proj", w).set_lora_b(rng.standard_normal((16, 2)))
    adapter.save_pretrained(tmp_path)
    x = rng.standard_normal((4, 24)).astype(np.float32)
    loaded = LoraAdapter.from_pretrained(tmp_path, {"m.q_proj": w})
    np.testing.assert_array_equal(
        loaded.forward_layer("m.q_proj", x), loaded.forward_layer("m.q_proj", x)
    )
    trainable = LoraAdapter.from_pretrained(tmp_path, {"m.q_proj": w}, is_trainable=True)
    assert trainable["m.q_proj"].training


def test_disable_unmerges_a_merged_layer_as_peft_does() -> None:
    adapter = small_adapter()
    layer = adapter["model.layers.0.self_attn.q_proj"]
    x = np.random.default_rng(1).standard_normal((3, 24)).astype(np.float32)
    plain = x @ np.asarray(layer.weight).T
    layer.merge()
    layer.disable()
    assert not layer.merged
    np.testing.assert_allclose(layer.forward(x), plain, rtol=1e-5, atol=1e-5)


def test_all_linear_leaves_the_output_layer_alone() -> None:
    config = LoraConfig(target_modules="all-linear")
    assert config.targets("model.layers.3.mlp.down_proj") and not config.targets("lm_head")


def test_reprs_say_what_a_layer_and_an_adapter_are() -> None:
    adapter = small_adapter(dora=True, quantized=True)
    assert "2 layers" not in repr(adapter) and "4 layers" in repr(adapter)
    layer = adapter["model.layers.0.self_attn.q_proj"]
    text = repr(layer)
    assert text.startswith("QLoraLinear('model.layers.0.self_attn.q_proj'")
    assert "r=4" in text and "use_dora" in text and "base=nf4/64" in text
