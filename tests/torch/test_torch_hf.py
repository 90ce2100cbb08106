"""nybble.torch inside transformers and PEFT, on the CPU, with a tiny random Llama built from
transformers' config classes (attention biases on, so that biases are carried too):

- `from_pretrained(..., quantization_config=NybbleConfig())` quantizes on load: every linear
  layer but the head holds the codes nybble.quantize gives its float weight (bit for bit),
  and the logits equal those of the float model whose weights nybble quantized directly, and
  the float model's within NF4's error;
- the saved checkpoint (bitsandbytes' tensors, `quant_method: "nybble"`) loads back; a
  bitsandbytes NF4 checkpoint loads into nybble layers through `pretrained_config`;
- PEFT: `target_modules="all-linear"` finds the layers, the fused forward and backward equal
  PEFT's own LoRA path (dropout included), an adapter trains, saves PEFT's files and reloads
  (with and without nybble's layer registered), `merge_and_unload` re-quantizes W + BA;
- HF Trainer and TRL's SFTTrainer with gradient checkpointing; torch.compile(fullgraph=True);
  generate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nybble

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
nt = pytest.importorskip("nybble.torch")
from nybble.torch._peft import LoraLinear4bit  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYERS = 2


def llama_config() -> Any:
    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        attention_bias=True,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 tiny Llama saved as transformers saves it."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path


def float_model(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def nybble_model(path: Path, **config: Any) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=nt.NybbleConfig(**config), dtype=torch.float32
    ).eval()


def quantized_directly(path: Path, double_quant: bool) -> Any:
    """The float model with each projection swapped for Linear4bit.from_linear."""
    model = float_model(path)
    for name, module in list(model.named_modules()):
        if name.rpartition(".")[2] in PROJECTIONS:
            layer = nt.Linear4bit.from_linear(module, double_quant=double_quant)
            model.set_submodule(name, layer)
    return model


def logits(model: Any, ids: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def linear4bits(model: Any) -> dict[str, Any]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nt.Linear4bit)}


# --- transformers ------------------------------------------------------------------------------


@pytest.mark.parametrize("dq", [False, True])
def test_from_pretrained_quantizes_on_load_bit_for_bit(checkpoint: Path, dq: bool) -> None:
    model = nybble_model(checkpoint, double_quant=dq)
    reference = float_model(checkpoint)
    layers = linear4bits(model)
    assert len(layers) == LAYERS * len(PROJECTIONS)
    assert type(model.lm_head) is torch.nn.Linear  # transformers' default: the head stays
    floats = dict(reference.named_modules())
    for name, layer in layers.items():
        w = floats[name].weight.detach().numpy()
        q = nybble.quantize(w, double_quant=dq)
        np.testing.assert_array_equal(layer.weight.view(-1).numpy(), q.codes, err_msg=name)
        assert layer.double_quant == dq and layer.weight_dtype == torch.float32
        if layer.bias is not None:
            assert torch.equal(layer.bias, floats[name].bias)
    got = logits(model, IDS)
    assert torch.equal(got, logits(quantized_directly(checkpoint, dq), IDS))
    # Within NF4's error of the float model, and equal (up to float32 sums) to the float
    # model holding the dequantized weights.
    want = logits(reference, IDS)
    assert float((got - want).norm() / want.norm()) < 0.15
    for name, layer in layers.items():
        floats[name].weight.data = layer.dequantize(torch.float32)
    torch.testing.assert_close(got, logits(reference, IDS), rtol=1e-5, atol=1e-5)


def test_a_saved_nybble_checkpoint_has_bitsandbytes_tensors_and_loads_back(
    checkpoint: Path, tmp_path: Path
) -> None:
    from safetensors import safe_open

    model = nybble_model(checkpoint, double_quant=True, skip_modules=["lm_head", "down_proj"])
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "nybble"
    assert config["quantization_config"]["double_quant"] is True
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        prefix = "model.layers.0.self_attn.q_proj.weight"
        assert f.get_tensor(prefix).dtype == torch.uint8
        assert f.get_tensor(prefix).shape == (64 * 64 // 2, 1)
    for suffix in ("absmax", "quant_map", "nested_absmax", "nested_quant_map"):
        assert f"{prefix}.{suffix}" in keys
    assert f"{prefix}.quant_state.bitsandbytes__nf4" in keys
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert len(linear4bits(back)) == LAYERS * (len(PROJECTIONS) - 1)
    assert torch.equal(logits(back, IDS), logits(model, IDS))


def test_a_bitsandbytes_checkpoint_loads_into_nybble_layers(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A checkpoint whose config names bitsandbytes' NF4 (as bitsandbytes saves it; the
    tensors are its format) loads without bitsandbytes through pretrained_config."""
    model = nybble_model(checkpoint, double_quant=True)
    model.save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    config.quantization_config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "bitsandbytes" and saved["load_in_4bit"] is True
    read = nt.pretrained_config(tmp_path)
    assert read.quantization_config["quant_method"] == "nybble"
    assert read.quantization_config["double_quant"] is True
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, config=read).eval()
    for name, layer in linear4bits(model).items():
        theirs = back.get_submodule(name)
        assert isinstance(theirs, nt.Linear4bit), name
        assert torch.equal(theirs.weight, layer.weight) and torch.equal(theirs.absmax, layer.absmax)
    assert torch.equal(logits(back, IDS), logits(model, IDS))

    saved["bnb_4bit_quant_type"] = "fp4"
    (tmp_path / "config.json").write_text(
        json.dumps(
            {**json.loads((tmp_path / "config.json").read_text()), "quantization_config": saved}
        )
    )
    with pytest.raises(ValueError, match="bnb_4bit_quant_type='fp4'"):
        nt.pretrained_config(tmp_path)


def test_nybble_config_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="unknown argument"):
        nt.NybbleConfig(bits=4)
    with pytest.raises(ValueError, match="blocksize"):
        nt.NybbleConfig(blocksize=48)
    with pytest.raises(ValueError, match="compute_dtype"):
        nt.NybbleConfig(compute_dtype="int8")
    config = nt.NybbleConfig(double_quant=True, compute_dtype="bfloat16", skip_modules=["x"])
    again = nt.NybbleConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict() and again.compute_dtype == torch.bfloat16
    bnb = config.to_bnb()
    assert bnb.bnb_4bit_quant_type == "nf4" and bnb.bnb_4bit_use_double_quant is True
    assert nt.NybbleConfig.from_bnb(bnb).to_dict() == config.to_dict()


def test_dequantize_gives_back_plain_linear_layers(checkpoint: Path) -> None:
    model = nybble_model(checkpoint)
    want = logits(model, IDS)
    model.dequantize()
    assert not linear4bits(model)
    torch.testing.assert_close(logits(model, IDS), want, rtol=1e-5, atol=1e-5)


def test_generate(checkpoint: Path) -> None:
    model = nybble_model(checkpoint, double_quant=True)
    direct = quantized_directly(checkpoint, True)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        ours = model.generate(IDS[:1], **kwargs)
        theirs = direct.generate(IDS[:1], **kwargs)
    assert ours.shape == (1, 12 + 8) and torch.equal(ours, theirs)


def test_compile_fullgraph_of_a_quantized_model(checkpoint: Path) -> None:
    """The whole model's forward traced as one graph (dynamo + AOT autograd over the
    operators' fake implementations; the inductor backend is exercised by
    tests/torch/test_torch_ops.py)."""
    model = nybble_model(checkpoint, double_quant=True)
    want = logits(model, IDS)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(logits(compiled, IDS), want)


# --- PEFT --------------------------------------------------------------------------------------


def peft_model(path: Path, dropout: float = 0.0, **config: Any) -> Any:
    base = nybble_model(path, **config)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(base, nt.register_lora(lora))


def lora_layers(model: Any) -> dict[str, Any]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear4bit)}


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_fused_lora_equals_pefts_own_path(checkpoint: Path, dropout: float) -> None:
    model = peft_model(checkpoint, dropout=dropout, double_quant=True)
    layers = lora_layers(model)
    assert len(layers) == LAYERS * len(PROJECTIONS)  # all-linear: every projection, no head
    layer = next(iter(layers.values()))
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    model.train()
    x = torch.randn(3, 5, 64)
    results = []
    for forward in (layer.forward, lambda x: peft.tuners.lora.layer.Linear.forward(layer, x)):
        torch.manual_seed(7)  # the same dropout mask on both paths
        xi = x.clone().requires_grad_()
        y = forward(xi)
        y.backward(torch.ones_like(y))
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        results.append((y.detach(), xi.grad, a.grad.clone(), b.grad.clone()))
        a.grad = b.grad = None
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_an_adapter_trains_saves_pefts_files_and_reloads(checkpoint: Path, tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = peft_model(checkpoint, dropout=0.1, double_quant=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    model.train()
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    want = logits(model, IDS)
    model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    from safetensors import safe_open

    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * LAYERS * len(PROJECTIONS)

    registered = nt.register_lora(peft.LoraConfig.from_pretrained(tmp_path / "adapter"))
    base = nybble_model(checkpoint, double_quant=True)
    back = peft.PeftModel.from_pretrained(base, tmp_path / "adapter", config=registered)
    assert len(lora_layers(back)) == LAYERS * len(PROJECTIONS)
    assert torch.equal(logits(back, IDS), want)
    # Unregistered, PEFT's own LoRA layer wraps the nybble layers: the same function.
    plain = peft.PeftModel.from_pretrained(
        nybble_model(checkpoint, double_quant=True), tmp_path / "adapter"
    )
    assert not lora_layers(plain)
    torch.testing.assert_close(logits(plain, IDS), want, rtol=1e-5, atol=1e-5)


def test_merge_and_unload_requantizes_w_plus_ba(checkpoint: Path) -> None:
    model = peft_model(checkpoint)
    for layer in lora_layers(model).values():
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.02)
    model.eval()
    before = logits(model, IDS)
    name = "base_model.model.model.layers.1.mlp.up_proj"
    layer = model.get_submodule(name)
    w = layer.base_layer.dequantize(torch.float32) + layer.get_delta_weight("default").float()
    with pytest.warns(UserWarning, match="Merging LoRA into a 4-bit nybble Linear4bit"):
        merged = model.merge_and_unload()
    assert not lora_layers(merged) and len(linear4bits(merged)) == LAYERS * len(PROJECTIONS)
    up = merged.model.layers[1].mlp.up_proj
    np.testing.assert_array_equal(
        up.weight.view(-1).numpy(), nybble.quantize(w.detach().numpy()).codes
    )
    after = logits(merged, IDS)  # W + BA rounded to NF4 again: NF4's error, as on load
    assert float((after - before).norm() / before.norm()) < 0.15


def test_dora_is_refused_by_name(checkpoint: Path) -> None:
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True)
    with pytest.raises(ValueError, match="DoraLinearVariant is not supported"):
        peft.get_peft_model(nybble_model(checkpoint), nt.register_lora(lora))


def test_hf_trainer_with_gradient_checkpointing(checkpoint: Path, tmp_path: Path) -> None:
    model = peft.prepare_model_for_kbit_training(nybble_model(checkpoint, double_quant=True))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, nt.register_lora(lora))
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(4))

    class Batches(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": ids[i], "labels": ids[i]}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=10,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        gradient_checkpointing=True,
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Batches())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 10 and np.mean(losses[-3:]) < np.mean(losses[:3])
    assert model.base_model.model.model.gradient_checkpointing
    assert lora_layers(model)


def test_trl_sft_trainer_with_gradient_checkpointing(checkpoint: Path, tmp_path: Path) -> None:
    """TRL's SFTTrainer as its docs show it (a text dataset, a tokenizer, `peft_config`), with
    the LoRA config passed through register_lora: nybble's layers train."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    words = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0")
    )
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="w1", eos_token="w2"
    )
    rng = np.random.default_rng(4)
    texts = [" ".join(f"w{j}" for j in rng.integers(3, 256, 16)) for _ in range(8)]
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=10,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        gradient_checkpointing=True,
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        max_length=32,
    )
    trainer = trl.SFTTrainer(
        model=nybble_model(checkpoint, double_quant=True),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
        peft_config=nt.register_lora(lora),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 10 and np.mean(losses[-3:]) < np.mean(losses[:3])
    assert len(lora_layers(trainer.model)) == LAYERS * len(PROJECTIONS)


def test_compile_fullgraph_of_a_peft_training_step(checkpoint: Path) -> None:
    model = peft_model(checkpoint, double_quant=True)
    for layer in lora_layers(model).values():
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.02)
    model.eval()  # no dropout: the two runs see the same function
    params = [p for p in model.parameters() if p.requires_grad]

    def step(run: Any) -> tuple[Any, list[Any]]:
        loss = run(input_ids=IDS, labels=IDS).loss
        grads = torch.autograd.grad(loss, params)
        return loss.detach(), list(grads)

    want_loss, want_grads = step(model)
    loss, grads = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
