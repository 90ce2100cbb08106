"""Small pretrained-model folders for the tests: a byte-level BPE tokenizer with a ChatML
template (written with the `tokenizers` library, as a model's tokenizer.json is), and
checkpoints of tiny random models written by nybble (or, in the parity tests, transformers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nybble.models.tokenizer import bytes_to_unicode
from nybble.train import Trainer, TransformerConfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: 256 bytes, a few merges, 3 special tokens
VOCAB = 256 + 6 + len(SPECIALS)


def write_tokenizer(directory: Path) -> None:
    """tokenizer.json (byte-level BPE: the 256 bytes, six merges, three special tokens) and
    tokenizer_config.json (EOS <|im_end|>, ChatML)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors

    spelling = bytes_to_unicode()
    vocab = {spelling[b]: b for b in range(256)}
    merges = [("t", "h"), ("th", "e"), ("Ġ", "t"), ("Ġt", "h"), ("i", "n"), ("a", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIALS])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_config(**changes: Any) -> TransformerConfig:
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        initializer_range=0.2,
    )
    base.update(changes)
    return TransformerConfig(**base)  # type: ignore[arg-type]


def write_model(directory: Path, config: TransformerConfig | None = None, seed: int = 3) -> Trainer:
    """A random model's checkpoint folder (float32 safetensors + config.json + tokenizer), and
    the trainer that made it."""
    trainer = Trainer(config or tiny_config(), None, seed=seed)
    trainer.save_model(directory)
    write_tokenizer(directory)
    return trainer
