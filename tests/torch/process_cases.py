"""What the tests of nybble.torch over several processes share
(tests/torch/test_torch_distributed.py: FSDP2, DDP, FSDP1; test_torch_deepspeed.py: ZeRO-3):
the tiny Llama they train, saved as a float checkpoint, and a free port for the processes'
rendezvous. Needs torch and transformers (the callers import-skip without them)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any


def llama_config() -> Any:
    """Two decoder layers of hidden size 64, attention biases on (so that biases are carried
    too), an untied head."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        attention_bias=True,
        tie_word_embeddings=False,
    )


def save_llama(path: Path) -> Path:
    """The tiny Llama with torch's seed-0 weights, saved as a float32 checkpoint at `path`."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
