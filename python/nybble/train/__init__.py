"""Training: a decoder-only LM (HF Llama's modules and math) fine-tuned with LoRA, QLoRA or
fully, with hand-written backward passes, on the CPU or the GPU (docs/training.md).

    from nybble.train import Trainer, TransformerConfig
    trainer = Trainer(TransformerConfig.tiny(), LoraConfig(r=8, alpha=16), lr=1e-2)
    loss = trainer.train_batch(inputs, targets)
"""

from .config import MODEL_TYPES, RopeScaling, TransformerConfig
from .data import corpus, corpus_batch
from .model import DecoderLM
from .trainer import IGNORE_INDEX, Trainer

__all__ = [
    "IGNORE_INDEX",
    "MODEL_TYPES",
    "DecoderLM",
    "RopeScaling",
    "Trainer",
    "TransformerConfig",
    "corpus",
    "corpus_batch",
]
