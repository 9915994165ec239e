"""GPTQ checkpoints (AutoGPTQ / optimum layout) imported exactly into ``QuantizedWeight``.

Per linear layer: ``qweight`` int32 ``[in·bits/32, out]`` (each run of ``bits`` words along the input axis is a
little-endian bit stream of 32 codes), ``qzeros`` int32 ``[groups, out·bits/32]`` (the same along the output
axis), ``scales`` float16 ``[groups, out]`` and ``g_idx`` ``[in]``. The weight is ``scale·(q − zero)`` with
``zero = stored + 1`` in AutoGPTQ's original ("gptq", v1) convention and ``zero = stored`` in ``gptq_v2``.
In tmac's convention ``w = s·(q − 2^(b−1)) − z`` that is ``z = s·(zero − 2^(b−1))``, exact in float64.
``desc_act`` checkpoints (act-order, a permuted ``g_idx``) are refused.
"""

from __future__ import annotations

import numpy as np

from tmac.base.formats import PER_ROW, WeightFormat
from tmac.base.qweight import QuantizedWeight

BITS = (2, 3, 4)
VERSIONS = ("gptq", "gptq_v2")


def unpack_codes(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Codes from int32 ``words``, read as consecutive little-endian bit streams of ``bits`` words along ``axis``."""
    w = np.moveaxis(np.ascontiguousarray(words).view(np.uint32), axis, -1)
    if w.shape[-1] % bits:
        raise ValueError(f"{w.shape[-1]} words along the packed axis is not a multiple of bits={bits}")
    runs = w.reshape(*w.shape[:-1], -1, bits).astype(np.uint64)  # one run = 32 codes
    mask = np.uint64((1 << bits) - 1)
    codes = []
    for k in range(32):
        word, off = divmod(bits * k, 32)
        value = runs[..., word] >> np.uint64(off)
        if off + bits > 32:  # 3 bits: a code straddles two words
            value |= runs[..., word + 1] << np.uint64(32 - off)
        codes.append(value & mask)
    out = np.stack(codes, axis=-1).reshape(*runs.shape[:-2], -1).astype(np.uint8)
    return np.moveaxis(out, -1, axis)


def import_gptq(qweight, qzeros, scales, g_idx, bits: int, group_size: int, version: str = "gptq") -> QuantizedWeight:
    """The exact ``QuantizedWeight`` ``[out, in]`` of one GPTQ layer (numpy arrays in, as stored)."""
    if bits not in BITS:
        raise ValueError(f"GPTQ bits={bits} is not supported; supported: {BITS}")
    if version not in VERSIONS:
        raise ValueError(f"GPTQ checkpoint_format {version!r} is not supported; supported: {VERSIONS}")
    qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
    if qweight.dtype != np.int32 or qzeros.dtype != np.int32 or qweight.ndim != 2 or qzeros.ndim != 2:
        raise ValueError(f"qweight/qzeros must be 2-D int32, got {qweight.dtype}{qweight.shape} / "
                         f"{qzeros.dtype}{qzeros.shape}")
    k, m = qweight.shape[0] * 32 // bits, qweight.shape[1]
    group = k if group_size in (-1, None) else group_size
    if group <= 0 or k % group:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    groups = k // group
    if scales.shape != (groups, m) or qzeros.shape != (groups, m * bits // 32):
        raise ValueError(f"scales {scales.shape} / qzeros {qzeros.shape} do not fit [{groups}, {m}] at {bits} bits")
    if g_idx is not None:
        g_idx = np.asarray(g_idx)
        if g_idx.shape != (k,) or not np.array_equal(g_idx, np.arange(k) // group):
            raise ValueError("g_idx is not the identity grouping: desc_act (act-order) checkpoints are not supported; "
                             "re-quantize with desc_act=False")
    codes = unpack_codes(qweight, bits, axis=0)  # [in, out]
    zero = unpack_codes(qzeros, bits, axis=1).astype(np.float64) + (1 if version == "gptq" else 0)  # [groups, out]
    s = scales.astype(np.float64)
    if not np.isfinite(s).all():
        raise ValueError("scales contain NaN or inf")
    fmt_group = PER_ROW if groups == 1 else group
    half = scales.dtype == np.float16  # checkpoints store float16 scales; the zeros s·(z − offset) are not
    fmt = WeightFormat(f"gptq_w{bits}g{group}", bits, fmt_group, has_zeros=True,
                       scale_dtype="float16" if half else "float32")
    z = s * (zero - fmt.offset)
    return QuantizedWeight(np.ascontiguousarray(codes.T), np.ascontiguousarray(s.T), np.ascontiguousarray(z.T), fmt)
