"""The trainer (nybble.train, with nybble.models): config, gradients, contracts, the Trainer and
its commands, datasets, pretrained and GGUF models, its CUDA kernels (emulated and on a GPU),
and parity with transformers + PEFT."""
