"""The checkpoint tools against transformers, bitsandbytes and PEFT themselves (run where they
are installed: the GPU machine; docs/checkpoints.md):

- a checkpoint written by `quantize --format bnb` loads with `from_pretrained` as a 4-bit
  model and gives the logits transformers gives when it quantizes the same dense checkpoint
  itself (load with a BitsAndBytesConfig);
- a 4-bit checkpoint transformers saved dequantizes in nybble to bitsandbytes' own values;
- `merge` equals PEFT's `merge_and_unload` (LoRA, rsLoRA, DoRA);
- `--device cuda` gives the CPU's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nybble.checkpoint import (
    Checkpoint,
    dequantize_checkpoint,
    merge_adapter,
    quantize_checkpoint,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.gpu

SMALL = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("bitsandbytes")


def _dense_model(directory: Path, model_type: str, dtype: Any, seed: int = 0) -> Any:
    """A randomly initialised model of the architecture, saved as transformers saves it."""
    config = transformers.AutoConfig.for_model(model_type, **SMALL)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(directory)
    return model


def _load(path: Path, **kwargs: Any) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _bnb_config(quant_type: str, double_quant: bool) -> Any:
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def _linear4bit_weights(model: Any) -> dict[str, Any]:
    import bitsandbytes as bnb

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w = module.weight
            out[name] = bnb.functional.dequantize_4bit(w.data, w.quant_state).cpu()
    return out


@pytest.mark.parametrize(
    ("model_type", "quant_type", "double_quant"),
    [("llama", "nf4", True), ("qwen2", "nf4", False), ("mistral", "fp4", True)],
)
def test_bnb_layout_loads_in_transformers_with_its_own_logits(
    tmp_path: Path, model_type: str, quant_type: str, double_quant: bool
) -> None:
    _cuda()
    _dense_model(tmp_path / "dense", model_type, torch.bfloat16)
    quantize_checkpoint(
        tmp_path / "dense",
        tmp_path / "q",
        layout="bnb",
        codebook=quant_type,  # type: ignore[arg-type]
        double_quant=double_quant,
        compute_dtype="bfloat16",
    )
    ours = _load(tmp_path / "q", device_map="cuda")
    theirs = _load(
        tmp_path / "dense",
        quantization_config=_bnb_config(quant_type, double_quant),
        device_map="cuda",
    )
    w_ours, w_theirs = _linear4bit_weights(ours), _linear4bit_weights(theirs)
    assert set(w_ours) == set(w_theirs) and len(w_ours) == 7 * SMALL["num_hidden_layers"]
    for name, a in w_ours.items():
        b = w_theirs[name]
        # bitsandbytes' CUDA quantizer differs from its CPU rule (which nybble follows) only
        # next to thresholds and in double quantization's offset rounding (docs/bitsandbytes.md)
        equal = (a == b).float().mean().item()
        assert equal > 0.98, (name, equal)
        assert (a - b).abs().mean().item() < 1e-3 * b.abs().mean().item() + 1e-6, name
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        l_ours = ours(ids.cuda()).logits.float()
        l_theirs = theirs(ids.cuda()).logits.float()
    rel = ((l_ours - l_theirs).norm() / l_theirs.norm()).item()
    assert rel < 0.02, rel
    assert (l_ours.argmax(-1) == l_theirs.argmax(-1)).float().mean().item() > 0.9


def test_a_4bit_checkpoint_transformers_saved_dequantizes_to_bitsandbytes_values(
    tmp_path: Path,
) -> None:
    _cuda()
    _dense_model(tmp_path / "dense", "llama", torch.bfloat16)
    model = _load(
        tmp_path / "dense", quantization_config=_bnb_config("nf4", True), device_map="cuda"
    )
    model.save_pretrained(tmp_path / "saved")
    expected = _linear4bit_weights(model)
    report = dequantize_checkpoint(tmp_path / "saved", tmp_path / "dense_again", dtype="float32")
    assert report.count("dequantized") == len(expected)
    config = json.loads((tmp_path / "dense_again" / "config.json").read_text())
    assert "quantization_config" not in config
    with Checkpoint(tmp_path / "dense_again") as ckpt:
        for module, w in expected.items():
            # bitsandbytes dequantizes to the model's dtype (bf16): the float32 products
            # rounded (to nearest even) as it rounds them; identical but for subnormal
            # products, which its kernels flush to zero
            got = torch.from_numpy(ckpt.read(f"{module}.weight")).to(w.dtype)
            assert torch.allclose(got.float(), w.float(), rtol=0, atol=1e-30), module
    # and it converts to nybble's layout losslessly (same values once dequantized)
    quantize_checkpoint(tmp_path / "saved", tmp_path / "nyb")
    dequantize_checkpoint(tmp_path / "nyb", tmp_path / "nyb_dense", dtype="float32")
    with Checkpoint(tmp_path / "dense_again") as a, Checkpoint(tmp_path / "nyb_dense") as b:
        for name in a.names():
            assert a.read(name).tobytes() == b.read(name).tobytes(), name
    # the dense checkpoint nybble wrote loads in transformers
    _load(tmp_path / "dense_again")


def _peft_adapter(base: Any, directory: Path, **config: Any) -> Any:
    """A PEFT model over `base` with random (non-zero) B and DoRA magnitudes, saved."""
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS, **config)
    model = peft.get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
            elif "lora_magnitude" in name:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize(
    ("dtype", "config"),
    [
        ("float32", {}),
        ("float32", {"use_rslora": True}),
        ("float32", {"use_dora": True}),
        ("bfloat16", {}),
    ],
)
def test_merge_equals_peft_merge_and_unload(
    tmp_path: Path, dtype: str, config: dict[str, Any]
) -> None:
    torch_dtype = getattr(torch, dtype)
    base = _dense_model(tmp_path / "dense", "llama", torch_dtype)
    model = _peft_adapter(base, tmp_path / "adapter", **config)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        peft_logits = model(ids).logits.float()
        reference = {k: v.float().numpy() for k, v in model.merge_and_unload().state_dict().items()}
    report = merge_adapter(tmp_path / "dense", tmp_path / "adapter", tmp_path / "merged")
    assert report.count("merged") == 7 * SMALL["num_hidden_layers"]
    with Checkpoint(tmp_path / "merged") as ckpt:
        for name in ckpt.names():
            got = ckpt.read(name).astype(np.float32)
            want = reference[name]
            if dtype == "float32":
                np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7, err_msg=name)
            else:  # PEFT adds the bf16-rounded delta in bf16; nybble rounds once
                np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6, err_msg=name)
    merged = _load(tmp_path / "merged", dtype=torch_dtype)
    with torch.no_grad():
        logits = merged(ids).logits.float()
    rel = ((logits - peft_logits).norm() / peft_logits.norm()).item()
    assert rel < (1e-4 if dtype == "float32" else 0.02), rel


def test_merge_into_a_4bit_base_equals_merging_its_dequantized_weights(tmp_path: Path) -> None:
    _cuda()
    _dense_model(tmp_path / "dense", "llama", torch.bfloat16)
    quantize_checkpoint(tmp_path / "dense", tmp_path / "q", layout="bnb", double_quant=True)
    dequantize_checkpoint(tmp_path / "q", tmp_path / "deq", dtype="float32")
    base = _load(tmp_path / "deq", dtype=torch.float32)
    model = _peft_adapter(base, tmp_path / "adapter", use_dora=True)
    with torch.no_grad():
        reference = {k: v.float().numpy() for k, v in model.merge_and_unload().state_dict().items()}
    merge_adapter(tmp_path / "q", tmp_path / "adapter", tmp_path / "merged", dtype="float32")
    with Checkpoint(tmp_path / "merged") as ckpt:
        for name in ckpt.names():
            got = ckpt.read(name).astype(np.float32)
            np.testing.assert_allclose(got, reference[name], rtol=2e-6, atol=2e-7, err_msg=name)


def test_device_cuda_gives_the_cpus_bytes(tmp_path: Path) -> None:
    _cuda()
    pytest.importorskip("cupy")
    _dense_model(tmp_path / "dense", "qwen2", torch.bfloat16)
    for layout in ("nybble", "bnb"):
        cpu = quantize_checkpoint(tmp_path / "dense", tmp_path / f"{layout}_cpu", layout=layout)  # type: ignore[arg-type]
        gpu = quantize_checkpoint(
            tmp_path / "dense",
            tmp_path / f"{layout}_gpu",
            layout=layout,
            device="cuda",  # type: ignore[arg-type]
        )
        assert cpu.files == gpu.files
        for f in cpu.files:
            assert (tmp_path / f"{layout}_cpu" / f).read_bytes() == (
                tmp_path / f"{layout}_gpu" / f
            ).read_bytes(), f
    dequantize_checkpoint(tmp_path / "bnb_cpu", tmp_path / "d_cpu")
    dequantize_checkpoint(tmp_path / "bnb_cpu", tmp_path / "d_gpu", device="cuda")
    assert (tmp_path / "d_cpu" / "model.safetensors").read_bytes() == (
        tmp_path / "d_gpu" / "model.safetensors"
    ).read_bytes()
    base = _load(tmp_path / "dense", dtype=torch.float32)
    _peft_adapter(base, tmp_path / "adapter")
    merge_adapter(tmp_path / "bnb_cpu", tmp_path / "adapter", tmp_path / "m_cpu", dtype="float32")
    merge_adapter(
        tmp_path / "bnb_cpu",
        tmp_path / "adapter",
        tmp_path / "m_gpu",
        dtype="float32",
        device="cuda",
    )
    with Checkpoint(tmp_path / "m_cpu") as a, Checkpoint(tmp_path / "m_gpu") as b:
        for name in a.names():
            np.testing.assert_allclose(
                b.read(name), a.read(name), rtol=1e-5, atol=1e-6, err_msg=name
            )
