"""The Trainer's API on the CPU: determinism, accumulation, gradient checkpointing, dropout,
the ignore index, checkpoints (exact resumption, refusals, atomic writes), PEFT adapter files
(saved, reloaded by nybble with the same loss), the exported base model, and input errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nybble import LoraAdapter, LoraConfig, safetensors_io
from nybble.errors import FormatError
from nybble.train import IGNORE_INDEX, Trainer, TransformerConfig, corpus_batch
from nybble.train.model import PROJECTIONS

TINY = TransformerConfig.tiny()
X = np.arange(1, 9)[None, :]
Y = np.arange(2, 10)[None, :]


def make(**kwargs: Any) -> Trainer:
    kwargs.setdefault("lora", LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    kwargs.setdefault("lr", 0.01)
    return Trainer(TINY, **kwargs)


def run(t: Trainer, start: int, n: int) -> list[float]:
    return [t.train_batch(*corpus_batch(i, 2, 12)) for i in range(start, start + n)]


@pytest.mark.parametrize("quant", [None, "nf4"])
def test_same_seed_same_losses_bit_for_bit(quant: str | None) -> None:
    a, b = run(make(quant=quant), 0, 5), run(make(quant=quant), 0, 5)
    assert a == b
    assert run(make(quant=quant, seed=1), 0, 5) != a


def test_accumulation_averages_micro_batches() -> None:
    """Two micro-batches of one row each give the update of one batch of both rows."""
    x, y = corpus_batch(0, 2, 12)
    acc = make(accumulation_steps=2)
    whole = make()
    acc.train_batch(x[:1], y[:1])
    assert acc.step == 0 and acc.micro_steps == 1
    acc.train_batch(x[1:], y[1:])
    whole.train_batch(x, y)
    assert acc.step == whole.step == 1
    for name, p in whole.named_parameters().items():
        np.testing.assert_allclose(acc.named_parameters()[name], p, rtol=1e-5, atol=1e-7)


def test_gradient_checkpointing_trains_identically() -> None:
    lora = LoraConfig(r=4, alpha=8, dropout=0.1, target_modules="all-linear")
    plain = run(make(lora=lora), 0, 4)
    ckpt = run(make(lora=lora, gradient_checkpointing=True), 0, 4)
    assert plain == ckpt


def test_dropout_trains_and_loss_is_evaluation() -> None:
    lora = LoraConfig(r=4, alpha=8, dropout=0.3, target_modules="all-linear")
    t = make(lora=lora)
    assert run(t, 0, 3) != run(make(), 0, 3)
    x, y = corpus_batch(0, 2, 12, holdout=True)
    assert t.loss(x, y) == t.loss(x, y)
    assert all(layer.training for layer in t.lora_layers().values())


def test_ignored_targets_do_not_count() -> None:
    t = make()
    x, y = corpus_batch(3, 1, 12)
    masked = y.copy()
    masked[0, 6:] = IGNORE_INDEX
    prefix_only = t.loss(x[:, :6], y[:, :6])  # causal: the first 6 positions see the same
    assert t.loss(x, masked) == pytest.approx(prefix_only, rel=1e-6)


def test_names_and_kinds() -> None:
    t = make(lora=LoraConfig(r=2, alpha=4, target_modules=("q_proj", "down_proj")))
    assert t.is_lora
    assert set(t.named_parameters()) == {
        f"model.layers.{i}.{p}.lora_{ab}.weight"
        for i in range(2)
        for p in ("self_attn.q_proj", "mlp.down_proj")
        for ab in "AB"
    }
    full = make(lora=None)
    names = set(full.named_parameters())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "model.layers.1.mlp.up_proj.weight" in names and "model.norm.weight" in names
    assert len(names) == 2 * (2 + len(PROJECTIONS)) + 3
    assert sum(int(p.size) for p in full.named_parameters().values()) == TINY.num_parameters()


@pytest.mark.parametrize("quant", [None, "nf4"])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_checkpoint_resumes_exactly(tmp_path: Path, quant: str | None, accumulation: int) -> None:
    lora = LoraConfig(r=4, alpha=8, dropout=0.1, target_modules="all-linear")
    straight = make(lora=lora, quant=quant, accumulation_steps=accumulation)
    first = run(straight, 0, 5)
    path = tmp_path / "state.safetensors"
    straight.save_checkpoint(path, extra={"next_batch": 5, "losses": first})
    rest = run(straight, 5, 5)

    resumed = make(lora=lora, quant=quant, accumulation_steps=accumulation)
    extra = resumed.load_checkpoint(path)
    assert extra == {"next_batch": 5, "losses": first}
    assert (resumed.step, resumed.micro_steps) == (5 // accumulation, 5 % accumulation)
    assert run(resumed, 5, 5) == rest
    assert [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]
    assert (path.stat().st_mode & 0o777) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_checkpoint_refuses_another_setup(tmp_path: Path) -> None:
    path = tmp_path / "state.safetensors"
    make().save_checkpoint(path)
    with pytest.raises(FormatError) as e:
        make(lora=LoraConfig(r=8, alpha=8, target_modules="all-linear")).load_checkpoint(path)
    assert e.value.field == "lora"
    with pytest.raises(FormatError) as e:
        make(lr=0.02).load_checkpoint(path)
    assert e.value.field == "lr"
    with pytest.raises(FormatError) as e:
        make(seed=4).load_checkpoint(path)
    assert e.value.field == "seed"
    make(gradient_checkpointing=True).load_checkpoint(path)  # changes no number


def test_checkpoint_refuses_other_files(tmp_path: Path) -> None:
    t = make()
    t.save_adapter(tmp_path / "adapter")
    with pytest.raises(FormatError):
        t.load_checkpoint(tmp_path / "adapter" / "adapter_model.safetensors")
    (tmp_path / "junk").write_bytes(b"\x00" * 20)
    with pytest.raises(FormatError):
        t.load_checkpoint(tmp_path / "junk")
    path = tmp_path / "state.safetensors"
    t.save_checkpoint(path)
    tensors = safetensors_io.load(path)
    with safetensors_io.SafeTensorsFile(path) as f:
        record = json.loads(f.metadata["nybble.train"])
    record["micro_steps"] = 7
    safetensors_io.save(
        {k: np.array(v) for k, v in tensors.items()}, path, {"nybble.train": json.dumps(record)}
    )
    with pytest.raises(FormatError) as e:
        t.load_checkpoint(path)
    assert e.value.field == "micro_steps"


@pytest.mark.parametrize("quant", [None, "nf4"])
def test_adapter_round_trip(tmp_path: Path, quant: str | None) -> None:
    t = make(quant=quant)
    run(t, 0, 10)
    held = corpus_batch(0, 4, 12, holdout=True)
    trained = t.loss(*held)
    t.save_adapter(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    fresh = make(quant=quant)
    assert fresh.loss(*held) != trained
    fresh.load_adapter(tmp_path)
    assert fresh.loss(*held) == trained
    # nybble's own reader over the exported base gives the same layers
    base = {k: v for k, v in t.state_dict().items() if "_proj" in k}
    adapter = LoraAdapter.from_pretrained(tmp_path, base)
    name = "model.layers.1.mlp.down_proj"
    np.testing.assert_array_equal(adapter[name].lora_b, t.lora_layers()[name].lora_b)


def test_load_adapter_refuses_a_different_adapter(tmp_path: Path) -> None:
    make(lora=LoraConfig(r=4, alpha=8, target_modules=("q_proj",))).save_adapter(tmp_path / "q")
    with pytest.raises(ValueError):
        make().load_adapter(tmp_path / "q")
    make(lora=LoraConfig(r=4, alpha=4, target_modules="all-linear")).save_adapter(tmp_path / "a")
    with pytest.raises(ValueError):
        make().load_adapter(tmp_path / "a")
    with pytest.raises(ValueError):
        make(lora=None).save_adapter(tmp_path / "full")


def test_save_model_writes_an_hf_checkpoint(tmp_path: Path) -> None:
    t = make(lora=None)
    run(t, 0, 2)
    t.save_model(tmp_path)
    assert TransformerConfig.from_hf(tmp_path) == TINY
    weights = safetensors_io.load(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(
        weights["model.layers.0.self_attn.q_proj.weight"],
        t.named_parameters()["model.layers.0.self_attn.q_proj.weight"],
    )
    assert set(weights) == set(t.state_dict())


@pytest.mark.parametrize(
    "inputs, targets",
    [
        (np.array([[1, 2, 256]]), np.array([[2, 3, 4]])),
        (np.array([[1, 2, -1]]), np.array([[2, 3, 4]])),
        (np.array([[1, 2, 3]]), np.array([[2, 3, -5]])),
        (np.array([[1, 2, 3]]), np.array([[2, 3]])),
        (np.array([[1.0, 2.0]]), np.array([[2, 3]])),
        (np.array([[1, 2]]), np.array([[IGNORE_INDEX, IGNORE_INDEX]])),
        (np.zeros((1, 0), np.int64), np.zeros((1, 0), np.int64)),
        (np.zeros((1, 1, 2), np.int64), np.zeros((1, 1, 2), np.int64)),
    ],
)
def test_bad_batches_are_value_errors(inputs: Any, targets: Any) -> None:
    t = make()
    with pytest.raises(ValueError):
        t.train_batch(inputs, targets)
    assert t.step == 0 and t.micro_steps == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0},
        {"lr": float("nan")},
        {"device": "tpu"},
        {"seed": -1},
        {"quant": "fp8"},
        {"compute_dtype": "float16"},
        {"accumulation_steps": 0},
        {"lora": LoraConfig(r=65, alpha=8)},  # beyond min(in, out) = 64
        {"lora": LoraConfig(r=4, alpha=8, target_modules=())},
    ],
)
def test_bad_settings_are_value_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        make(**kwargs)


def test_non_finite_training_is_refused_before_an_update() -> None:
    from nybble.errors import NonFiniteError

    t = make()
    layer = next(iter(t.lora_layers().values()))
    layer.lora_a[0, 0] = np.inf
    before = t.named_parameters()["model.layers.1.mlp.down_proj.lora_A.weight"].copy()
    with pytest.raises(NonFiniteError):
        t.train_batch(X, Y)
    assert t.step == 0 and t.micro_steps == 0
    after = t.named_parameters()["model.layers.1.mlp.down_proj.lora_A.weight"]
    np.testing.assert_array_equal(after, before)


def test_train_epoch_needs_batches() -> None:
    with pytest.raises(ValueError):
        make().train_epoch([])
