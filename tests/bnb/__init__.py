"""bitsandbytes compatibility (nybble.bnb): golden fixtures from bitsandbytes on the CPU and on
CUDA, and the state-dict fuzz suite."""
