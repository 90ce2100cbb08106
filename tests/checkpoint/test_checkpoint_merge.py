"""`merge_adapter`: PEFT's merge (W + s·B·A; DoRA's m·(W + s·B·A)/‖·‖_row; rsLoRA's
s = alpha/sqrt(r); rank and alpha patterns) computed a tile of rows at a time, against the
same math written out in float64, for dense and 4-bit bases (docs/checkpoints.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import nybble
from nybble.checkpoint import Checkpoint, merge_adapter, quantize_checkpoint
from nybble.checkpoint import merge as merge_module
from tests import FIXTURES
from tests.checkpoint.test_checkpoint_fixtures import (
    make_checkpoint,
    make_config,
    random_weights,
    write_adapter,
    write_checkpoint,
)

PREFIX = "base_model.model."


def _expected(
    w: np.ndarray, lora: dict[str, np.ndarray], module: str, scaling: float
) -> np.ndarray:
    """PEFT's merged weight in float64 (fan_in_fan_out false)."""
    a = lora[f"{PREFIX}{module}.lora_A.weight"].astype(np.float64)
    b = lora[f"{PREFIX}{module}.lora_B.weight"].astype(np.float64)
    merged = w.astype(np.float64) + scaling * (b @ a)
    m = lora.get(f"{PREFIX}{module}.lora_magnitude_vector")
    if m is not None:
        merged *= (m.astype(np.float64) / np.linalg.norm(merged, axis=1))[:, None]
    return merged


def _read(directory: Path) -> dict[str, np.ndarray]:
    with Checkpoint(directory) as ckpt:
        return {n: ckpt.read(n) for n in ckpt.names()}


def _close(got: np.ndarray, want: np.ndarray, dtype: Any) -> None:
    """Within one rounding to `dtype` (float32 products, then one rounding)."""
    eps = float(np.finfo(np.float32).eps) if dtype == np.float32 else 2.0**-8
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2 * eps, atol=1e-6)


@pytest.mark.parametrize(
    ("arch", "dora", "rslora", "tile_bytes"),
    [("llama", False, False, None), ("qwen2", True, False, 4096), ("mistral", False, True, 2048)],
)
def test_merge_into_a_dense_base(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    dora: bool,
    rslora: bool,
    tile_bytes: int | None,
) -> None:
    if tile_bytes is not None:  # several tiles per weight, a short last one joining the one before
        monkeypatch.setattr(merge_module, "TILE_BYTES", tile_bytes)
    config = make_config(arch, intermediate=136)
    tensors = {k: v.astype(np.float32) for k, v in random_weights(config).items()}
    write_checkpoint(tmp_path / "base", config, tensors, shards=2)
    lora = write_adapter(tmp_path / "ad", tensors, r=4, alpha=8.0, use_dora=dora, use_rslora=rslora)
    report = merge_adapter(tmp_path / "base", tmp_path / "ad", tmp_path / "out")
    scaling = 8.0 / (math.sqrt(4) if rslora else 4)
    merged = _read(tmp_path / "out")
    modules = {k[len(PREFIX) :].rsplit(".lora_", 1)[0] for k in lora}
    assert sorted(report.weights["merged"]) == sorted(f"{m}.weight" for m in modules)
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if module in modules:
            assert merged[name].dtype == np.float32
            _close(merged[name], _expected(w, lora, module, scaling), np.float32)
        else:
            assert merged[name].tobytes() == w.tobytes()
    # the same adapter through nybble's in-memory LoraAdapter gives the same weights
    base = {f"{m}.weight": tensors[f"{m}.weight"] for m in modules}
    adapter = nybble.LoraAdapter.from_pretrained(tmp_path / "ad", base)
    for name, w in adapter.merged_weights().items():
        np.testing.assert_allclose(merged[name], w, rtol=1e-6, atol=1e-7)


def test_bf16_base_keeps_its_dtype_and_rank_patterns_apply(tmp_path: Path) -> None:
    _, tensors = make_checkpoint(tmp_path / "base", "llama")
    lora = write_adapter(
        tmp_path / "ad",
        tensors,
        r=4,
        alpha=8.0,
        extra={"alpha_pattern": {"down_proj": 2.0}},
    )
    merge_adapter(tmp_path / "base", tmp_path / "ad", tmp_path / "out")
    merged = _read(tmp_path / "out")
    for module in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"):
        scaling = (2.0 if module.endswith("down_proj") else 8.0) / 4
        got = merged[f"{module}.weight"]
        assert got.dtype == ml_dtypes.bfloat16
        _close(
            got.astype(np.float32),
            _expected(tensors[f"{module}.weight"], lora, module, scaling),
            "bf16",
        )
    merge_adapter(tmp_path / "base", tmp_path / "ad", tmp_path / "out32", dtype="f32")
    assert _read(tmp_path / "out32")["model.layers.0.mlp.down_proj.weight"].dtype == np.float32


@pytest.mark.parametrize("layout", ["nybble", "bnb"])
def test_merge_into_a_4bit_base_writes_it_dense(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    monkeypatch.setattr(merge_module, "TILE_BYTES", 8192)
    config = make_config("qwen3")
    tensors = random_weights(config)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        # all-zero rows beside a large one: their decoded nested scales come out below 0
        w = tensors[name].astype(np.float32)
        w[5] = 0
        w[0] *= 10
        tensors[name] = w.astype(ml_dtypes.bfloat16)
        assert float(np.min(nybble.quantize(tensors[name], 64, True).absmax)) < 0
    write_checkpoint(tmp_path / "base", config, tensors)
    quantize_checkpoint(tmp_path / "base", tmp_path / "q", layout=layout, double_quant=True)  # type: ignore[arg-type]
    lora = write_adapter(tmp_path / "ad", tensors, use_dora=True)
    report = merge_adapter(tmp_path / "q", tmp_path / "ad", tmp_path / "out", dtype="float32")
    assert report.count("merged") == 6 and report.count("dequantized") == 14 - 6
    merged = _read(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    modules = {k[len(PREFIX) :].rsplit(".lora_", 1)[0] for k in lora}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if ".layers." in name and name.endswith("_proj.weight"):
            deq = nybble.quantize(w, 64, True).dequantize("float32")
            assert merged[name].dtype == np.float32
            if module in modules:
                _close(merged[name], _expected(deq, lora, module, 2.0), np.float32)
            else:
                assert merged[name].tobytes() == deq.tobytes()
        else:
            assert merged[name].tobytes() == w.tobytes()


def test_fan_in_fan_out_base(tmp_path: Path) -> None:
    """A Conv1D-style base stored [in, out] (GPT-2), with fan_in_fan_out in the config."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((48, 80)).astype(np.float32)  # [in, out]
    write_checkpoint(tmp_path / "base", {"model_type": "gpt2"}, {"h.0.attn.c_attn.weight": w})
    a = rng.standard_normal((2, 48)).astype(np.float32)
    b = rng.standard_normal((80, 2)).astype(np.float32)
    from nybble import safetensors_io

    (tmp_path / "ad").mkdir()
    safetensors_io.save(
        {f"{PREFIX}h.0.attn.c_attn.lora_A.weight": a, f"{PREFIX}h.0.attn.c_attn.lora_B.weight": b},
        tmp_path / "ad" / "adapter_model.safetensors",
    )
    (tmp_path / "ad" / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 2,
                "lora_alpha": 4,
                "target_modules": ["c_attn"],
                "fan_in_fan_out": True,
            }
        )
    )
    merge_adapter(tmp_path / "base", tmp_path / "ad", tmp_path / "out")
    got = _read(tmp_path / "out")["h.0.attn.c_attn.weight"]
    want = w.astype(np.float64) + 2.0 * (b.astype(np.float64) @ a).T
    _close(got, want, np.float32)


# --- tensors PEFT saves beside LoRA's (modules_to_save, trainable tokens) ---------------------

EXTRAS = FIXTURES / "peft_extras"
EXTRA_CASES = sorted(p.name for p in EXTRAS.iterdir() if p.is_dir())


def _copy_case(case: str, tmp_path: Path) -> tuple[Path, Path]:
    """A fixture's base and adapter, copied to change them."""
    import shutil

    shutil.copytree(EXTRAS / case, tmp_path / case)
    return tmp_path / case / "base", tmp_path / case


def _rewrite(path: Path, change: Any) -> None:
    tensors = dict(nybble.safetensors_io.load(path))
    nybble.safetensors_io.save(change(tensors), path, {"format": "pt"})


@pytest.mark.parametrize("case", EXTRA_CASES)
def test_merge_equals_peft_merge_and_unload_with_extra_tensors(tmp_path: Path, case: str) -> None:
    """Fixtures PEFT 0.21 wrote (tests/fixtures/make_peft_fixtures.py): the merged checkpoint
    is PEFT's `merge_and_unload()` saved, tensor for tensor (bit for bit but for the LoRA
    products' float32 rounding, which is each BLAS's own): a modules_to_save
    copy in place of the base's weight, trainable tokens' rows in the embedding (a tied
    lm_head follows it, as it stays tied)."""
    report = merge_adapter(EXTRAS / case / "base", EXTRAS / case, tmp_path / "out")
    got = _read(tmp_path / "out")
    want = nybble.safetensors_io.load(EXTRAS / case / "merged.safetensors")
    assert set(got) == set(want)
    base = nybble.safetensors_io.load(EXTRAS / case / "base" / "model.safetensors")
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        if name.endswith("_proj.weight") and not np.array_equal(want[name], base[name]):
            # W + s·B·A: the product's rounding is the BLAS's (torch's vs nybble's GEMM)
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
        else:  # the extras and untouched weights: bit for bit
            assert np.array_equal(got[name], want[name]), name
    if case == "modules_to_save":
        replaced = ["lm_head.weight", "model.embed_tokens.weight"]
        assert sorted(report.weights["replaced"]) == replaced
    else:
        replaced = ["model.embed_tokens.weight"]
        assert "model.embed_tokens.weight" in report.weights["merged"]
    assert all(not np.array_equal(got[n], base[n]) for n in replaced), "the extras were merged"


@pytest.mark.parametrize("case", EXTRA_CASES)
def test_extra_tensors_merge_into_bf16_and_4bit_bases(tmp_path: Path, case: str) -> None:
    """The adapter's values are cast to the base weight's dtype as torch's copy into it
    rounds them; a 4-bit base weight is replaced (or its rows) in the dtype it was quantized
    from."""
    base, adapter = _copy_case(case, tmp_path)
    _rewrite(
        base / "model.safetensors",
        lambda t: {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()},
    )
    extras = {
        k: v
        for k, v in nybble.safetensors_io.load(adapter / "adapter_model.safetensors").items()
        if "lora_" not in k
    }
    quantize_checkpoint(base, tmp_path / "q", targets=["embed_tokens", "q_proj"])
    for source in (base, tmp_path / "q"):
        merge_adapter(source, adapter, tmp_path / "out", overwrite=True)
        got = _read(tmp_path / "out")
        embed = got["model.embed_tokens.weight"]
        assert embed.dtype == ml_dtypes.bfloat16
        for key, value in extras.items():
            if key.endswith("trainable_tokens_delta"):
                config = json.loads((adapter / "adapter_config.json").read_text())
                ids = config["trainable_token_indices"]
                rows = ids if isinstance(ids, list) else ids["embed_tokens"]
                assert np.array_equal(embed[rows], value.astype(ml_dtypes.bfloat16))
                others = [i for i in range(embed.shape[0]) if i not in rows]
                if source == base:
                    dense = nybble.safetensors_io.load(base / "model.safetensors")
                    assert np.array_equal(embed[others], dense["model.embed_tokens.weight"][others])
            else:
                name = key.removeprefix(PREFIX)
                assert np.array_equal(got[name], value.astype(ml_dtypes.bfloat16)), name


def test_extra_tensors_that_cannot_be_merged_exactly_are_refused(tmp_path: Path) -> None:
    def refused(base: Path, adapter: Path, field: str | None = None) -> nybble.FormatError:
        with pytest.raises(nybble.FormatError) as e:
            merge_adapter(base, adapter, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
        if field is not None:
            assert e.value.field == field, e.value
        return e.value

    base, adapter = _copy_case("modules_to_save", tmp_path)
    key = f"{PREFIX}lm_head.weight"
    # A tied base: PEFT's merge unties lm_head from the embeddings; nybble does not.
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert "PEFT's merge unties" in refused(base, adapter, "tie_word_embeddings").problem
    (base / "config.json").write_text(json.dumps(config))
    # A resized vocabulary: the shapes differ.
    weights = adapter / "adapter_model.safetensors"
    original = weights.read_bytes()
    _rewrite(weights, lambda t: {**t, key: np.ones((20, 8), np.float32)})
    assert "resized vocabulary" in refused(base, adapter, key).problem
    # A tensor the base does not hold.
    weights.write_bytes(original)
    _rewrite(weights, lambda t: {**t, f"{PREFIX}lm_head.bias": np.ones(16, np.float32)})
    assert "does not hold" in refused(base, adapter, f"{PREFIX}lm_head.bias").problem
    # A weight changed by LoRA and replaced as well.
    weights.write_bytes(original)
    q = "model.layers.0.self_attn.q_proj"
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(
        json.dumps({**acfg, "modules_to_save": ["lm_head", "q_proj"]})
    )
    _rewrite(weights, lambda t: {**t, f"{PREFIX}{q}.weight": np.ones((8, 8), np.float32)})
    assert "no one merged value" in refused(base, adapter, f"{PREFIX}{q}.weight").problem
    # Trainable tokens: ids repeated or beyond the vocabulary, a tied base storing lm_head.
    base, adapter = _copy_case("trainable_tokens", tmp_path / "t")
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    tokens = f"{PREFIX}model.embed_tokens.token_adapter.trainable_tokens_delta"
    for ids in ([1, 1, 7], [1, 5, 16]):
        (adapter / "adapter_config.json").write_text(
            json.dumps({**acfg, "trainable_token_indices": ids})
        )
        assert "distinct and below" in refused(base, adapter, tokens).problem
    (adapter / "adapter_config.json").write_text(json.dumps(acfg))
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert "also stores lm_head" in refused(base, adapter, "tie_word_embeddings").problem


def test_the_command_line_reports_replaced_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nybble.cli import main

    d = EXTRAS / "modules_to_save"
    assert main(["merge", str(d / "base"), str(d), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "2 merged, 2 replaced" in out
