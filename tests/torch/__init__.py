"""nybble.torch: the operators, Linear4bit, transformers and PEFT integration,
torch.distributed, docs/torch.md, and the GPU benchmark smoke test."""
