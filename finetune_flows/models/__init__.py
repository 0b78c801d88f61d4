"""Models: sources, 4-bit quantization and dequantization, attention backends and kernels."""
