"""The codec: the Rust core against the numpy oracle, the named contracts, bad input and its
errors, safetensors reading and writing, and the codec fuzz suite."""
