"""The families: their records (arch), the one Transformer (llama), BitNet's activation quantization."""
