"""Pretrained models in the trainer: loading checkpoint folders (dense, 4-bit as stored, a Hub
id in the local cache), packed rows that keep samples apart, the key/value-cache decode path
against the training forward, generation, and merged exports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nybble import LoraConfig
from nybble.backends import get
from nybble.checkpoint import quantize_checkpoint
from nybble.errors import FormatError
from nybble.models import open_model, resolve
from nybble.train import DecoderLM, Trainer
from nybble.train.functional import IGNORE_INDEX
from nybble.train.generate import pick
from tests.pretrained_fixtures import VOCAB, tiny_config, write_model, write_tokenizer

pytest.importorskip("tokenizers")


def _dense64(config_changes: dict[str, object] | None = None, seed: int = 1) -> DecoderLM:
    """A float64 model with every weight trainable (exact comparisons)."""
    cfg = tiny_config(**(config_changes or {}))
    return DecoderLM(cfg, get("cpu"), compute_dtype="float64", seed=seed)


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


# --- packing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [{}, {"sliding_window": 3, "model_type": "mistral"}, {"qk_norm": True, "model_type": "qwen3"}],
)
def test_a_packed_row_is_its_samples_apart(changes: dict[str, object]) -> None:
    """Loss and every gradient of a row packing three samples (positions restarting, no
    attention across them) equal those of the three samples run alone."""
    m = _dense64(changes)
    lengths = [5, 9, 4]
    seqs = [_tokens(n + 1, i) for i, n in enumerate(lengths)]
    ids = np.concatenate([s[:-1] for s in seqs])[None]
    tgt = np.concatenate([s[1:] for s in seqs])[None]
    starts = np.concatenate([np.full(n, sum(lengths[:i])) for i, n in enumerate(lengths)])[None]
    count = int(ids.size)
    packed = float(m.forward_backward(ids, tgt, count, starts.astype(np.int32)))
    packed_grad = m.flat_gradients().copy()
    alone, grad = 0.0, np.zeros_like(packed_grad)
    for s in seqs:
        # each sample's summed loss (count = all targets of the row): the same normalisation
        alone += float(m.forward_backward(s[None, :-1], s[None, 1:], count))
        grad += m.flat_gradients()
    assert packed == pytest.approx(alone, rel=1e-12)
    np.testing.assert_allclose(packed_grad, grad, rtol=1e-9, atol=1e-13)


def test_packing_without_starts_would_mix_the_samples() -> None:
    """The check above can fail: the same row without sample starts gives another loss."""
    m = _dense64()
    seqs = [_tokens(6, 7), _tokens(7, 8)]
    ids = np.concatenate([s[:-1] for s in seqs])[None]
    tgt = np.concatenate([s[1:] for s in seqs])[None]
    starts = np.array([[0] * 5 + [5] * 6], np.int32)
    assert float(m.loss(ids, tgt, 11, starts)) != pytest.approx(float(m.loss(ids, tgt, 11)))


def test_the_trainer_checks_starts() -> None:
    t = Trainer(tiny_config(), LoraConfig(r=2, alpha=4))
    ids = _tokens(8, 0)[None]
    with pytest.raises(ValueError, match="starts"):
        t.train_batch(ids, ids, np.full((1, 8), 5))  # a start after its token
    with pytest.raises(ValueError, match="starts"):
        t.loss(ids, ids, np.zeros((1, 7)))


# --- the decode path -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"sliding_window": 4, "model_type": "mistral"},
        {"qk_norm": True, "model_type": "qwen3"},
        {"model_type": "qwen2", "biases": ("q_proj", "k_proj", "v_proj")},
        {"tie_word_embeddings": True},
    ],
)
def test_decoding_with_a_cache_gives_the_training_forwards_loss(
    changes: dict[str, object],
) -> None:
    """The cross-entropy of logits made token by token from the cache (after a prefill of
    the first three) equals the training forward's loss of the whole sequence."""
    m = _dense64(changes, seed=4)
    seq = _tokens(12, 5)
    cache = m.new_cache(1, 11)
    logits = [m.next_logits(seq[None, :3], cache, 0)]
    for pos in range(3, 11):
        logits.append(m.next_logits(seq[None, pos : pos + 1], cache, pos))
    rows = np.concatenate(logits)  # predictions of seq[3:12]
    z = rows - rows.max(axis=1, keepdims=True)
    ce = np.log(np.exp(z).sum(axis=1)) - z[np.arange(9), seq[3:12]]
    targets = np.where(np.arange(11) >= 2, seq[1:], IGNORE_INDEX)[None]
    assert float(m.loss(seq[None, :11], targets, 9)) == pytest.approx(ce.mean(), rel=1e-6)


def test_a_full_cache_is_refused() -> None:
    m = _dense64()
    cache = m.new_cache(1, 4)
    with pytest.raises(ValueError, match="cache holds 4"):
        m.next_logits(_tokens(5, 0)[None], cache, 0)


def test_pick() -> None:
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 3.0, 1.0, 2.9], np.float32)
    assert pick(logits, 0.0, 1.0, rng) == 1
    # probabilities .478, .433, .065, .024: top_p .45 keeps the first, .5 the first two
    assert {pick(logits, 1.0, 0.45, rng) for _ in range(50)} == {1}
    assert {pick(logits, 1.0, 0.5, rng) for _ in range(100)} == {1, 3}
    draws = [pick(logits, 1.0, 1.0, rng) for _ in range(400)]
    assert set(draws) == {0, 1, 2, 3}


# --- loading ---------------------------------------------------------------------------------


def test_a_saved_model_loads_with_the_same_losses(tmp_path: Path) -> None:
    trainer = write_model(tmp_path / "m")
    loaded = Trainer.from_pretrained(tmp_path / "m", LoraConfig(r=2, alpha=4))
    ids = _tokens(20, 1)[None]
    assert loaded.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(
        trainer.loss(ids[:, :-1], ids[:, 1:]), rel=1e-6
    )
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token == "<|im_end|>"
    assert loaded.adapter is not None
    assert loaded.adapter.base_model_name_or_path == str(tmp_path / "m")


@pytest.mark.parametrize("layout", ["bnb", "nybble"])
def test_a_4bit_checkpoint_is_used_as_stored(tmp_path: Path, layout: str) -> None:
    write_model(tmp_path / "dense")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "bnb", layout=layout, double_quant=True)
    write_tokenizer(tmp_path / "bnb")
    with open_model(tmp_path / "bnb") as files:
        stored = files.stored_quantized("model.layers.0.mlp.up_proj.weight")
    assert stored is not None and stored.nested is not None
    lora = LoraConfig(r=2, alpha=4, target_modules="all-linear")
    t = Trainer.from_pretrained(tmp_path / "bnb", lora, quant="nf4")
    q = t.lora_layers()["model.layers.0.mlp.up_proj"].qweight
    np.testing.assert_array_equal(q.codes, stored.codes)
    assert q.nested is not None
    # the same checkpoint read dense: its 4-bit weights dequantized
    dense = Trainer.from_pretrained(tmp_path / "bnb", lora)
    ids = _tokens(16, 2)[None]
    assert dense.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(
        t.loss(ids[:, :-1], ids[:, 1:]), rel=1e-5
    )


def test_a_hub_id_is_read_from_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / "abc123"
    write_model(snapshot)
    (cache / "models--org--tiny" / "refs").mkdir(parents=True)
    (cache / "models--org--tiny" / "refs" / "main").write_text("abc123\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve("org/tiny") == snapshot
    assert resolve("org/tiny@abc123") == snapshot
    Trainer.from_pretrained("org/tiny", LoraConfig(r=2, alpha=4))
    with pytest.raises(FormatError, match="downloads nothing"):
        resolve("org/absent")
    with pytest.raises(FormatError, match="not found"):
        resolve(str(tmp_path / "nowhere" / "x.y"))


def _edit_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "gemma2"}, "model_type"),
        ({"model_type": "phi3"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_hidden_layers": 3}, "model.layers.2.input_layernorm.weight"),
        ({"num_hidden_layers": 1}, "model.layers.1.input_layernorm.weight"),
        ({"intermediate_size": 48}, "model.layers.0.mlp.gate_proj.weight"),
    ],
)
def test_a_model_that_does_not_match_its_config_is_refused_by_name(
    tmp_path: Path, change: dict[str, object], field: str
) -> None:
    write_model(tmp_path / "m")
    _edit_config(tmp_path / "m", **change)
    with pytest.raises(FormatError) as e:
        Trainer.from_pretrained(tmp_path / "m", LoraConfig(r=2, alpha=4), quant="nf4")
    assert e.value.field == field


def test_a_checkpoint_without_tokenizer_still_trains_on_ids(tmp_path: Path) -> None:
    write_model(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").unlink()
    t = Trainer.from_pretrained(tmp_path / "m", LoraConfig(r=2, alpha=4))
    assert t.tokenizer is None
    ids = _tokens(9, 0)[None]
    assert np.isfinite(t.train_batch(ids[:, :-1], ids[:, 1:]))
    with pytest.raises(ValueError, match="tokenizer"):
        t.generate("hello")


# --- generation and exports ------------------------------------------------------------------


def test_generate_greedy_is_the_argmax_chain_and_stops_at_eos(tmp_path: Path) -> None:
    write_model(tmp_path / "m")
    t = Trainer.from_pretrained(tmp_path / "m", None, frozen=True)
    assert t.tokenizer is not None
    prompt = t.tokenizer.encode("the cat")
    out = t.generate(prompt, max_new_tokens=8)
    ids = list(prompt)
    for expected in out.ids:  # each token the argmax of a fresh full forward
        cache = t.model.new_cache(1, len(ids))
        logits = t.model.next_logits(np.array([ids]), cache, 0)
        assert int(np.argmax(logits[0])) == expected
        ids.append(expected)
    eos = t.tokenizer.eos_id
    assert eos is not None
    stopped = t.generate(prompt, max_new_tokens=8)
    assert stopped.stopped in ("stop", "length") and len(stopped.ids) <= 8
    texts: list[str] = []
    streamed = t.generate(
        "the cat", max_new_tokens=6, temperature=0.8, seed=3, on_text=texts.append
    )
    assert "".join(texts) == streamed.text
    assert t.generate("the cat", 6, 0.8, seed=3).ids == streamed.ids  # seeded


def test_generate_checks_its_arguments(tmp_path: Path) -> None:
    write_model(tmp_path / "m")
    t = Trainer.from_pretrained(tmp_path / "m", None, frozen=True)
    for kwargs in ({"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}):
        with pytest.raises(ValueError):
            t.generate([1, 2], **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token ids"):
        t.generate([VOCAB + 5])
    with pytest.raises(ValueError, match="frozen"):
        t.train_batch(np.array([[1, 2]]), np.array([[2, 3]]))


def test_the_merged_model_is_the_adapted_one(tmp_path: Path) -> None:
    write_model(tmp_path / "m")
    t = Trainer.from_pretrained(tmp_path / "m", LoraConfig(r=4, alpha=8), lr=1e-2)
    ids = _tokens(33, 9)[None]
    for _ in range(5):
        t.train_batch(ids[:, :-1], ids[:, 1:])
    t.save_merged(tmp_path / "merged", dtype="float32")
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"} <= {
        p.name for p in (tmp_path / "merged").iterdir()
    }
    merged = Trainer.from_pretrained(tmp_path / "merged", None, frozen=True)
    assert merged.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(
        t.loss(ids[:, :-1], ids[:, 1:]), rel=1e-5
    )
    with pytest.raises(FormatError, match="exists"):
        t.save_merged(tmp_path / "merged")
