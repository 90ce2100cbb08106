"""The convergence contracts of docs/contracts.md ("Training"), each a named test, with a
float32 base and with an NF4 base (QLoRA), on the CPU and on the GPU (marked `gpu`: bfloat16
activations, skipped without CUDA). The model is `TransformerConfig.tiny()`; unless a
contract says otherwise the batch is inputs 1..8 with targets 2..9 and one `train_batch` is
one optimizer step. Everything is seeded: each test is deterministic."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from nybble import LoraConfig
from nybble.train import Trainer, TransformerConfig, corpus_batch

INPUTS = np.arange(1, 9)[None, :]
TARGETS = np.arange(2, 10)[None, :]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BASES = ["f32", "nf4"]


def trainer(
    device: str, base: str, lora: LoraConfig | None = None, lr: float = 0.01, **kwargs: Any
) -> Trainer:
    return Trainer(
        TransformerConfig.tiny(),
        lora,
        lr=lr,
        quant="nf4" if base == "nf4" else None,
        device=device,
        seed=0,
        **kwargs,
    )


def train(t: Trainer, steps: int) -> list[float]:
    return [t.train_batch(INPUTS, TARGETS) for _ in range(steps)]


def host(a: Any) -> np.ndarray:
    return np.array(a.get() if hasattr(a, "get") else a)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("device", DEVICES)
def test_f_conv_003_lora_on_q_and_v_converges(device: str, base: str) -> None:
    t = trainer(device, base, LoraConfig(r=8, alpha=16, target_modules=("q_proj", "v_proj")))
    losses = train(t, 200)
    assert t.step == 200
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("device", DEVICES)
def test_f_conv_005_rslora_rank_64_stays_stable(device: str, base: str) -> None:
    """rsLoRA r=64, alpha=128 (scaling 16) on q and v, lr 0.05, 100 steps."""
    lora = LoraConfig(r=64, alpha=128, use_rslora=True, target_modules=("q_proj", "v_proj"))
    t = trainer(device, base, lora, lr=0.05)
    assert next(iter(t.lora_layers().values())).scaling == 16
    losses = np.array(train(t, 100))
    assert np.isfinite(losses).all()
    assert losses.max() <= 10 * losses[0]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("device", DEVICES)
def test_f_conv_006_higher_rank_is_no_worse(device: str, base: str) -> None:
    """Ranks 4, 16 and 32 on q and v with alpha 16, 200 steps each at lr 0.05."""
    final = {}
    for r in (4, 16, 32):
        t = trainer(device, base, LoraConfig(r=r, alpha=16), lr=0.05)
        final[r] = train(t, 200)[-1]
    assert final[32] <= 1.05 * final[4]


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("device", DEVICES)
def test_f_conv_007_varied_batches_beat_the_untrained_model(device: str, base: str) -> None:
    """200 different batches of the corpus (4 x 16 bytes), one step each; the loss is taken
    on held-out text."""
    t = trainer(device, base, LoraConfig(r=8, alpha=16))
    held_out = corpus_batch(0, 8, 16, holdout=True)
    untrained = t.loss(*held_out)
    for i in range(200):
        t.train_batch(*corpus_batch(i, 4, 16))
    assert t.step == 200
    assert t.loss(*held_out) < untrained


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("device", DEVICES)
def test_f_conv_008_three_epochs_lower_the_mean_loss(device: str, base: str) -> None:
    t = trainer(device, base, LoraConfig(r=8, alpha=16))
    batches = [corpus_batch(i, 2, 16) for i in range(50)]
    means = [t.train_epoch(batches) for _ in range(3)]
    assert t.step == 150
    assert means[2] < means[0]


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("device", DEVICES)
def test_f_edge_001_rank_1_trains(device: str, base: str) -> None:
    t = trainer(device, base, LoraConfig(r=1, alpha=2))
    losses = train(t, 50)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("device", DEVICES)
def test_f_edge_002_rank_equal_to_hidden_is_finite_and_trains(device: str, base: str) -> None:
    t = trainer(device, base, LoraConfig(r=64, alpha=128))
    assert {layer.config.r for layer in t.lora_layers().values()} == {64}
    losses = np.array(train(t, 50))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("device", DEVICES)
def test_f_edge_003_q_proj_only(device: str, base: str) -> None:
    t = trainer(device, base, LoraConfig(r=8, alpha=16, target_modules=("q_proj",)))
    layers = t.lora_layers()
    assert sorted(layers) == [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    v_name = "model.layers.0.self_attn.v_proj.weight"
    v_before = t.state_dict()[v_name]
    assert all(".v_proj" not in name for name in t.named_parameters())
    train(t, 20)
    for layer in layers.values():
        assert np.abs(host(layer.lora_b)).max() > 0
    np.testing.assert_array_equal(t.state_dict()[v_name], v_before)


@pytest.mark.parametrize("device", DEVICES)
def test_f_edge_006_no_lora_is_full_fine_tuning(device: str) -> None:
    t = trainer(device, "f32", None)
    assert not t.is_lora and t.lora_layers() == {}
    names = ["q_proj", "k_proj", "v_proj", "o_proj"]
    attention = [f"model.layers.{i}.self_attn.{n}.weight" for i in range(2) for n in names]
    assert set(attention) <= set(t.named_parameters())
    before = {name: host(t.named_parameters()[name]).copy() for name in attention}
    losses = train(t, 20)
    assert losses[-1] < losses[0]
    for name in attention:
        assert not np.array_equal(host(t.named_parameters()[name]), before[name])


@pytest.mark.parametrize("device", DEVICES)
def test_f_edge_006_nf4_base_needs_lora(device: str) -> None:
    with pytest.raises(ValueError, match="LoRA"):
        trainer(device, "nf4", None)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("device", DEVICES)
def test_f_edge_007_accumulation_of_4(device: str, base: str) -> None:
    t = trainer(device, base, LoraConfig(r=8, alpha=16), accumulation_steps=4)
    for _ in range(3):
        t.train_batch(INPUTS, TARGETS)
    assert t.step == 0
    assert all(np.abs(host(layer.lora_b)).max() == 0 for layer in t.lora_layers().values())
    t.train_batch(INPUTS, TARGETS)
    assert t.step == 1
    for _ in range(36):
        t.train_batch(INPUTS, TARGETS)
    assert t.step == 10
    assert all(np.abs(host(layer.lora_b)).max() > 0 for layer in t.lora_layers().values())
