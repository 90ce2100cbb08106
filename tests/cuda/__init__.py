"""The GPU codec and matmuls (backends/cuda), CUDA graphs, the one launch route, and every
shipped kernel compiled with NVRTC."""
