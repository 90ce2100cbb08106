"""docs/torch.md runs as written on the CPU: its Python blocks in order in one namespace, with
the checkpoints it names (`MODEL`, `BNB_CHECKPOINT`) replaced by a tiny random Llama saved
here (as a float checkpoint, and as one whose config names bitsandbytes' NF4 over the
tensors bitsandbytes writes), since the tests reach no hub."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests import ROOT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
nt = pytest.importorskip("nybble.torch")

PAGE = ROOT / "docs" / "torch.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.DOTALL)
NAMED = re.compile(r'^(MODEL|BNB_CHECKPOINT) = "[^"]+"', re.MULTILINE)


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(PAGE.read_text()) if lang == language]


def tiny_checkpoints(directory: Path) -> dict[str, str]:
    """A float tiny Llama (its vocabulary holds the page's token ids) and the same model
    quantized and saved with a bitsandbytes NF4 config."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=64,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    float_path = directory / "float"
    model.save_pretrained(float_path)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        float_path, quantization_config=nt.NybbleConfig(double_quant=True)
    )
    bnb_path = directory / "bnb"
    quantized.save_pretrained(bnb_path)
    saved = transformers.AutoConfig.from_pretrained(bnb_path)
    saved.quantization_config = nt.NybbleConfig(double_quant=True).to_bnb()
    saved.save_pretrained(bnb_path)
    return {"MODEL": str(float_path), "BNB_CHECKPOINT": str(bnb_path)}


def test_the_python_blocks_run_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = tiny_checkpoints(tmp_path)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "torch_md"}
    found = set()
    for i, body in enumerate(blocks("python")):

        def local(match: re.Match[str]) -> str:
            found.add(match.group(1))
            return f"{match.group(1)} = {paths[match.group(1)]!r}"

        exec(compile(NAMED.sub(local, body), f"docs/torch.md block {i}", "exec"), namespace)
    assert found == set(paths)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    model = namespace["model"]  # the bitsandbytes checkpoint's, in nybble layers
    assert any(isinstance(m, nt.Linear4bit) for m in model.modules())
    assert namespace["state"]["weight.quant_state.bitsandbytes__nf4"].dtype == torch.uint8


def test_the_switch_table_names_what_exists() -> None:
    """Every nybble.torch name the page's tables use is public."""
    text = PAGE.read_text()
    for name in set(re.findall(r"nybble\.torch\.(\w+)", text)):
        assert hasattr(nt, name), name
