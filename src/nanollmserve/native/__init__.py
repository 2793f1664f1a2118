"""Native CPU kernels: GGUF block matmuls and the fused single-stream decode step (C, built
once per machine by `build.py`)."""
