"""Quantization and kernel specs: weight layouts, the kernel spec, K-quants, quantizing, token tables, the kernel cache."""
