"""What the benches compare against: seeded weights and torch's own low-bit weight-only kernels."""
import numpy as np
import torch

COLD_BYTES = 1 << 30  # cycle through this many bytes of weight copies to defeat the caches


def random_weights(m, k, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((m, k), dtype=np.float32))


def int4pack(w, group=128):
    """Asymmetric 4-bit groups in the layout of ``aten._weight_int4pack_mm_for_cpu``: (packed, scales_and_zeros)."""
    m, k = w.shape
    g = w.reshape(m, -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo).clamp(min=1e-6) / 15
    q = ((g - lo) / s).round().clamp(0, 15).to(torch.int32).reshape(m, k)
    sz = torch.stack([s.reshape(m, -1).t(), (lo + 8 * s).reshape(m, -1).t()], -1).to(torch.bfloat16).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


def int4_linear(x, packed, group=128):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed[0], group, packed[1])
