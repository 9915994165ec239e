"""What the benches compare against: seeded weights and torch's own low-bit weight-only kernels."""
import numpy as np
import torch

from tmac.apps.bench import bench_group, int4_linear, int4pack  # noqa: F401
from tmac.base.timing import COLD_BYTES  # noqa: F401  (re-exported for the benches)



def random_weights(m, k, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((m, k), dtype=np.float32))
