"""Where a kernel holds a weight in another form than its import: IQ1_S on ISAs that expand grids.

A file's IQ1_S imports as a K-quant of 2-bit codes q = grid + 1 (``FORMATS["iq1_s"]``: scale d·a, zero
(d/8)·b − 2·d·a with a = 2s + 1 and b = 7a or 9a, the group's shift of +⅛ or −⅛), which every kernel runs. Where the
kernels expand grid indices (``Isa.expands_grids``) it is held as its indices instead, and the grid kernels take
IQ1_M's codebook codes (grid + 1) | shift << 2 with the scale d·a/8 (``IQ1_S_AS_CODES``): the same weights, exactly.
``held_format`` says which form a spec takes, ``held_weight`` makes it at packing and ``imported_weight`` the import's
form again at unpacking, so layers, files and checkpoints keep the import's format whatever their kernels hold.
"""

from __future__ import annotations

import numpy as np

from tmac.base.formats import FORMATS, IQ1_S_AS_CODES, WeightFormat
from tmac.base.qweight import QuantizedWeight, RowCodes

IQ1_S = FORMATS["iq1_s"]


def held_format(fmt: WeightFormat, isa, grid: str | None = None, super_groups: int | None = None) -> WeightFormat:
    """The format a kernel for ``fmt`` on ``isa`` holds its weights in: IQ1_S's codebook codes where the ISA expands
    grids (or ``grid`` asks for IQ1_S's; ``grid=""``: not) and the parameters are multipliers of super scales
    (``super_groups`` not 0: IQ1_S's own), else ``fmt``."""
    if fmt == IQ1_S and super_groups != 0 and (grid == IQ1_S_AS_CODES.gguf.type_name or
                                               grid is None and isa.expands_grids):
        return IQ1_S_AS_CODES
    return fmt


def held_weight(qw: QuantizedWeight, spec, factors=None):
    """``qw`` (and the ``factor_params`` of it the caller has) in the form ``spec`` holds: an IQ1_S import as
    codebook codes where the spec is IQ1_S's grid (``(weight, factors)`` as given otherwise)."""
    if qw.format != IQ1_S or spec.grid != IQ1_S_AS_CODES.gguf.type_name:
        return qw, factors
    from tmac.quant.kquant import factor_params

    (a, d), (b, m) = factors or factor_params(qw) or _unfactored(qw)
    s = d.astype(np.float64).repeat(IQ1_S.groups_per_super, axis=1) * a
    shifted = np.float64(8) * m.repeat(IQ1_S.groups_per_super, axis=1) * b  # 9·s for −⅛, 7·s for +⅛ (checked)
    minus, plus = shifted == 9 * s, shifted == 7 * s
    if not (minus | plus).all() or a.max(initial=0) > 15:
        r, g = np.argwhere(~(minus | plus) | (a > 15))[0]
        raise ValueError(f"this {IQ1_S.name} weight's group {g} of row {r} is not IQ1_S's (multiplier "
                         f"{a[r, g]}, shift {float(m[r, g // IQ1_S.groups_per_super] * b[r, g]):.3g})")
    shift = minus.astype(np.uint8) << 2

    def codes_of(q: np.ndarray, r0: int) -> np.ndarray:
        return q | shift[r0:r0 + len(q)].repeat(IQ1_S.group_size, axis=1)

    codes = RowCodes(qw.shape, lambda r0, r1: codes_of(np.asarray(qw.codes[r0:r1]), r0)) \
        if isinstance(qw.codes, RowCodes) else codes_of(qw.codes, 0)
    d8 = d / np.float32(8)
    held = ((a.astype(np.int8), d8), None)
    scales = d8.repeat(IQ1_S.groups_per_super, axis=1) * a.astype(np.float32)
    return QuantizedWeight(codes, scales, None, IQ1_S_AS_CODES, held), held


def imported_weight(qw: QuantizedWeight, fmt: WeightFormat) -> QuantizedWeight:
    """The inverse of ``held_weight``: ``qw``, unpacked in its held form, in the import's format ``fmt``."""
    if qw.format == fmt:
        return qw
    if qw.format != IQ1_S_AS_CODES or fmt != IQ1_S or qw.factors is None:
        raise ValueError(f"weights held as {qw.format.name} are not of format {fmt.name}")
    (a, d8), _ = qw.factors
    a = (a.astype(np.int16) & 15).astype(np.uint8)  # (the multiplier without the shifts packing put above it)
    g = IQ1_S.groups_per_super

    def group_shifts(codes: np.ndarray) -> np.ndarray:
        return codes[:, ::IQ1_S.group_size] >> 2

    codes = qw.codes
    if isinstance(codes, RowCodes):
        q = RowCodes(qw.shape, lambda r0, r1: np.asarray(codes[r0:r1]) & 3)
        shift = np.concatenate([group_shifts(np.asarray(codes[r0:r0 + 1024])) for r0 in range(0, qw.shape[0], 1024)])
    else:
        q, shift = codes & 3, group_shifts(codes)
    b = np.where(shift != 0, 9 * a, 7 * a).astype(np.uint8)
    d = d8 * np.float32(8)
    scales = d.repeat(g, axis=1) * a.astype(np.float32)
    zeros = d8.repeat(g, axis=1) * b.astype(np.float32) - np.float32(IQ1_S.offset) * scales
    return QuantizedWeight(q, scales, zeros, IQ1_S, ((a, d), (b, d8)))


def _unfactored(qw: QuantizedWeight):
    raise ValueError(f"this {qw.format.name} weight's parameters are not IQ1_S's multipliers of one scale a super "
                     f"group")
