"""PyTorch modules on the kernels: tmac.Linear, tuning, saving and loading, quantize_model."""
