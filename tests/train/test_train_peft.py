"""What nybble.train trains, HF + PEFT computes the same: the base weights (Trainer.state_dict)
loaded into the matching transformers model (Llama, Qwen3 with its q/k norms, Mistral with a
sliding window, tied and untied heads), the saved adapter loaded by PEFT with no missing keys,
and the loss of a batch equal to nybble's. Runs where torch, transformers and peft are
installed (the GPU machine); the `gpu` cases train on the GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nybble import LoraConfig
from nybble.train import Trainer, TransformerConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CONFIGS = {
    "tiny": TransformerConfig.tiny(),
    "qwen3": TransformerConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=256,
        tie_word_embeddings=True,
        qk_norm=True,
        model_type="qwen3",
        rope_theta=1e6,
    ),
    "mistral": TransformerConfig(
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=256,
        sliding_window=5,
        model_type="mistral",
    ),
}
CASES = [
    ("tiny", None, "cpu"),
    ("tiny", "nf4", "cpu"),
    ("qwen3", None, "cpu"),
    ("qwen3", "nf4", "cpu"),
    ("mistral", None, "cpu"),
    pytest.param("tiny", "nf4", "cuda", marks=pytest.mark.gpu),
    pytest.param("qwen3", None, "cuda", marks=pytest.mark.gpu),
]


def hf_model(config: TransformerConfig, weights: dict[str, np.ndarray]) -> Any:
    fields = config.to_hf()
    model_type = fields.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **fields)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="eager", dtype=torch.float32
    )
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}
    result = model.load_state_dict(state, strict=False)
    assert list(result.unexpected_keys) == []
    tied = ["lm_head.weight"] if config.tie_word_embeddings else []
    assert list(result.missing_keys) == tied
    return model.eval()


def hf_loss(model: Any, inputs: np.ndarray, targets: np.ndarray) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(inputs)).logits
    flat = logits.reshape(-1, logits.shape[-1]).double()
    return float(torch.nn.functional.cross_entropy(flat, torch.from_numpy(targets).reshape(-1)))


@pytest.mark.parametrize("name, quant, device", CASES)
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_peft_computes_the_loss_nybble_trained(
    tmp_path: Path, name: str, quant: str | None, device: str, compute: str
) -> None:
    if compute == "bfloat16" and device == "cpu":
        pytest.skip("bfloat16 activations are the GPU's")
    config = CONFIGS[name]
    lora = LoraConfig(r=4, alpha=8, target_modules="all-linear")
    t = Trainer(config, lora, lr=0.02, quant=quant, device=device, compute_dtype=compute)
    rng = np.random.default_rng(0)
    for _ in range(15):
        ids = rng.integers(0, config.vocab_size, (2, 12))
        t.train_batch(ids[:, :-1], ids[:, 1:])
    ids = rng.integers(0, config.vocab_size, (3, 12))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    ours = t.loss(inputs, targets)

    t.save_adapter(tmp_path)
    base = hf_model(config, t.state_dict())
    plain = hf_loss(base, inputs, targets)
    model = peft.PeftModel.from_pretrained(base, tmp_path, adapter_name="nybble")
    again = model.load_adapter(tmp_path, adapter_name="again")
    assert [k for k in again.missing_keys if "lora_" in k and ".again." in k] == []
    model.set_adapter("nybble")
    theirs = hf_loss(model, inputs, targets)
    assert abs(theirs - plain) > 1e-4  # the adapter changes the model
    rel = 2e-2 if compute == "bfloat16" else 2e-5
    assert ours == pytest.approx(theirs, rel=rel)
