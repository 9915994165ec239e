"""x86-64: AVX-512 (BW, optionally VNNI and VBMI) and AVX2 (optionally AVX-VNNI). ``vpshufb`` does the lookups
(``vpermb`` those into 64-entry tables, with VBMI); ``vpdpbusd`` (VNNI) or ``vpmaddubsw`` + ``vpmaddwd`` sum the bit
planes of a row."""

from __future__ import annotations

from dataclasses import dataclass

from tmac.kernels.base import Isa, broadcast_table, plane_weights


@dataclass(frozen=True)
class X86Isa(Isa):
    vnni: bool = False
    dot_rows: int = 32  # vpdpbusd or vpmaddubsw on unpacked codes beat the lookups from here (docs/decisions.md)

    @property
    def dot_two_bit_super_groups(self) -> bool:
        return True  # 1.1-1.5x the lookups from 64 rows on every ISA but VBMI's quads (docs/decisions.md, "IQ1_S")

    @property
    def dot_codebooks(self) -> bool:
        # levels + 128 as unsigned bytes: ``vpdpbusd`` sums their products in int32; ``vpmaddubsw``'s int16 pairs
        # would saturate (2·241·127 > 2^15), so without VNNI the levels are multiplied signed (``dot_signed_levels``)
        return True

    def dot_tile_of(self, spec) -> tuple:
        # a format without super groups pays a float epilogue every unit of 32; without VNNI its sums widen from
        # int16 besides, and the 2 x 4 tile's work spills: one weight-row vector at a time where registers are 16
        # (AVX2), and on AVX-512 for a codebook's signed levels, whose sign flips take registers too (docs/
        # decisions.md, "Dot products for many rows")
        if not spec.super_groups and not self.vnni and (self.vector_registers < 32 or spec.codebook):
            return (1, self.dot_tile[1])
        return self.dot_tile

    @property
    def dot_signed_levels(self) -> bool:
        # ``vpmaddubsw`` of |level| and the activation with the level's sign (``vpsignb``, llama.cpp's way for its
        # signed weights; AVX-512, which lacks it, negates under a mask): pairs of at most 2·127·127 < 2^15
        return not self.vnni

    @property
    def expands_grids(self) -> bool:
        return self.wide_lookup  # VBMI's two-table permute and multishift (docs/decisions.md, "Grid indices")

    def permute2(self, idx, low, high):
        """Byte i: entry ``idx[i] & 127`` of the 128 bytes ``low``, ``high`` (``vpermi2b``)."""
        from tvm import tirx

        return tirx.call_llvm_pure_intrin("uint8x64", "llvm.x86.avx512.vpermi2var.qi.512", low, idx, high)

    def multishift(self, offsets, data):
        """Byte i: the 8 bits from bit ``offsets[i] & 63`` of its 8-byte lane of ``data``, wrapping (``vpmultishiftqb``)."""
        from tvm import tirx

        return tirx.call_llvm_pure_intrin("uint8x64", "llvm.x86.avx512.pmultishift.qb.512", offsets, data)

    @property
    def _suffix(self) -> tuple[str, str, str]:
        """(pshufb, pmaddubsw, pmaddwd) intrinsic names for this vector width."""
        if self.vector_bytes == 64:
            return "avx512.pshuf.b.512", "avx512.pmaddubs.w.512", "avx512.pmaddw.d.512"
        return "avx2.pshuf.b", "avx2.pmadd.ub.sw", "avx2.pmadd.wd"

    def lookup(self, table16, idx):
        from tvm import tirx

        lanes = self.vector_bytes
        if self.low_nibble_lookup:  # vpermb reads an index's low 6 bits; in 4 copies of the table, its low 4
            return self.lookup64(broadcast_table(table16, lanes), idx)
        return tirx.call_llvm_pure_intrin(f"int8x{lanes}", f"llvm.x86.{self._suffix[0]}",
                                          broadcast_table(table16, lanes), idx)

    def lookup64(self, table64, idx):
        from tvm import tirx

        if not self.wide_lookup:
            return super().lookup64(table64, idx)
        return tirx.call_llvm_pure_intrin("int8x64", "llvm.x86.avx512.permvar.qi.512", table64, idx)

    def accumulate(self, acc, looked: list, planes: int, period: int, first: int):
        from tvm import tirx

        vb = self.vector_bytes
        maddubs = self._suffix[1]
        if planes == 1:
            # one plane (1 bit, ternary triples): the two lookups of a byte's nibbles are interleaved row by row
            # (vpunpck[lh]bw) and each pair summed by vpmaddubsw with ones — two instructions per vector where
            # sign-extending and adding both takes five. Rows land in the order ``acc_rows`` gives.
            ones = tirx.Broadcast(tirx.IntImm("int8", 1), vb)
            for lo, hi in zip(looked[0::2], looked[1::2]):
                halves = [tirx.call_llvm_pure_intrin(f"int16x{vb // 2}", f"llvm.x86.{maddubs}", ones,
                                                     tirx.Shuffle([lo, hi], _interleave(vb, first)))
                          for first in (0, 8)]
                acc = acc + tirx.Shuffle(halves, list(range(vb)))
            return acc
        w = plane_weights(vb, period, "int8", first)  # bit patterns 1,2,4,8 read as unsigned by the instructions
        if planes == 4 and self.vnni:
            for v in looked:
                acc = tirx.call_llvm_pure_intrin(f"int32x{vb // 4}", f"llvm.x86.avx512.vpdpbusd.{vb * 8}", acc, w, v)
            return acc
        # vpmaddubsw: int16 per byte pair, exact here (|sum| ≤ 2·(4+8)·127 < 2^15); the looked vectors are added
        # in int16 before widening, so a 4-plane step costs one vpmaddwd, not one per lookup — or none, where the
        # lut group is short enough to sum in int16 (``acc_dtype``) and ``widen`` pays one vpmaddwd per group
        pairs = [tirx.call_llvm_pure_intrin(f"int16x{vb // 2}", f"llvm.x86.{maddubs}", w, v) for v in looked]
        total = pairs[0]
        for p in pairs[1:]:
            total = total + p
        if planes == 2 or _sums_in_int16(acc):
            return acc + total
        return acc + self._pair_sums(total)

    def _pair_sums(self, v):
        """int32 sums of adjacent int16 lanes (vpmaddwd with ones)."""
        from tvm import tirx

        vb = self.vector_bytes
        ones = tirx.Broadcast(tirx.IntImm("int16", 1), vb // 2)
        return tirx.call_llvm_pure_intrin(f"int32x{vb // 4}", f"llvm.x86.{self._suffix[2]}", v, ones)

    def acc_dtype(self, planes: int, steps: int) -> str:
        # without VNNI a 4-plane step adds at most 2·(4+8)·127 = 3048 to an int16 lane, so lut groups of up to 10
        # steps (up to 80 activations: groups of 32 and 64, as GGUF's Q4/Q5 types have) sum in int16
        if planes == 4 and not self.vnni and steps * 2 * (4 + 8) * 127 < 1 << 15:
            return f"int16x{self.vector_bytes // 2}"
        return super().acc_dtype(planes, steps)

    def widen(self, acc, planes: int):
        if planes == 4 and _sums_in_int16(acc):
            return self._pair_sums(acc)
        return super().widen(acc, planes)

    def dot_acc_dtype(self, bits: int, quads: int, largest: int | None = None) -> str:
        # vpmaddubsw's pair sums of b-bit codes with int8 stay under 2·(2^b − 1)·127; in int16 while they add up
        largest = (1 << bits) - 1 if largest is None else largest
        if not self.vnni and quads * 2 * largest * 127 < 1 << 15:
            return f"int16x{self.vector_bytes // 2}"
        return super().dot_acc_dtype(bits, quads, largest)

    def dot(self, acc, w, x, signed: bool = False):
        from tvm import tirx

        vb = self.vector_bytes
        if self.vnni:
            return tirx.call_llvm_pure_intrin(f"int32x{vb // 4}", f"llvm.x86.avx512.vpdpbusd.{vb * 8}", acc, w, x)
        if signed and vb == 32:  # |w| · (x with w's sign): vpsignb
            sign = "llvm.x86.avx2.psign.b"
            x = tirx.call_llvm_pure_intrin(f"int8x{vb}", sign, x, w)
            w = tirx.call_llvm_pure_intrin(f"int8x{vb}", sign, w, w)
        elif signed:  # AVX-512 has no vpsignb: the negative weights' lanes negated (a mask from their sign bits)
            zero = tirx.Broadcast(tirx.IntImm("int8", 0), vb)
            negative = w < zero
            x = tirx.Select(negative, zero - x, x)
            w = tirx.Select(negative, zero - w, w)
        pairs = tirx.call_llvm_pure_intrin(f"int16x{vb // 2}", f"llvm.x86.{self._suffix[1]}", w, x)
        return acc + pairs if _sums_in_int16(acc) else acc + self._pair_sums(pairs)

    def dot_widen(self, acc):
        return self._pair_sums(acc) if _sums_in_int16(acc) else acc

    def dot_scaled(self, acc, mult):
        if not _sums_in_int16(acc):
            return super().dot_scaled(acc, mult)
        # vpmaddwd with the multiplier in both halves of a lane: the pair sums widened and scaled in one instruction
        from tvm import tirx

        vb = self.vector_bytes
        halves = (mult << tirx.Broadcast(tirx.IntImm("int32", 16), vb // 4)) | \
            (mult & tirx.Broadcast(tirx.IntImm("int32", 0xFFFF), vb // 4))
        return tirx.call_llvm_pure_intrin(f"int32x{vb // 4}", f"llvm.x86.{self._suffix[2]}", acc,
                                          tirx.reinterpret(f"int16x{vb // 2}", halves))

    def lane_mask(self, mask_bytes):
        if self.vector_bytes == 64:  # AVX-512: the mask is a k register as stored (kmovq, no vptestmb)
            from tvm import tirx

            return tirx.Cast("boolx64", tirx.reinterpret("uint1x64", mask_bytes))
        return super().lane_mask(mask_bytes)

    def acc_rows(self, planes: int) -> list[int] | None:
        """Lane q of a one-plane accumulator holds row ``acc_rows[q]``: the low 8 bytes of every 16-byte lane
        first (vpunpcklbw), then the high 8 (vpunpckhbw)."""
        if planes != 1:
            return None
        vb = self.vector_bytes
        return [lane + i for first in (0, 8) for lane in range(0, vb, 16) for i in range(first, first + 8)]


def _sums_in_int16(acc) -> bool:
    """Whether an accumulator holds int16 lanes (``acc_dtype``: short lut groups of 4 planes without VNNI)."""
    return str(acc.ty).startswith("int16")


def _interleave(vb: int, first: int) -> list[int]:
    """Shuffle indices into ``[lo, hi]`` pairing byte i of lo with byte i of hi, for bytes ``first .. first+7`` of
    every 16-byte lane (what vpunpcklbw / vpunpckhbw do)."""
    return [j for lane in range(0, vb, 16) for i in range(first, first + 8) for j in (lane + i, vb + lane + i)]


def _target(mcpu: str) -> dict:
    return {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": mcpu}


# every x86 kernel streaming its weights once (the GEMV, the GEMM of a few rows) prefetches them 4 KiB ahead into L1
# and 16 KiB ahead into L2: the hardware prefetcher alone kept below the read probe's bandwidth, and one core's L1
# fill buffers alone below what a second core adds (docs/decisions.md, "The weight stream is prefetched")
STREAM = {"prefetch_bytes": 4096, "prefetch_l2_bytes": 16384}
AVX512_VBMI = X86Isa("avx512_vbmi", "x86_64", 64, frozenset({"avx2", "avx512bw", "avx512vnni", "avx512vbmi"}),
                     {**_target("cascadelake"), "mattr": ["+avx512vbmi"]},
                     "AVX-512 BW + VNNI + VBMI: vpermb zmm, vpdpbusd", wide_lookup=True, low_nibble_lookup=True,
                     vnni=True, **STREAM)
AVX512_VNNI = X86Isa("avx512_vnni", "x86_64", 64, frozenset({"avx2", "avx512bw", "avx512vnni"}),
                     _target("cascadelake"), "AVX-512 BW + VNNI: vpshufb zmm, vpdpbusd", vnni=True, **STREAM)
AVX512 = X86Isa("avx512", "x86_64", 64, frozenset({"avx2", "avx512bw"}),
                _target("skylake-avx512"), "AVX-512 BW: vpshufb zmm, vpmaddubsw/vpmaddwd", **STREAM)
AVX2_VNNI = X86Isa("avx2_vnni", "x86_64", 32, frozenset({"avx2", "avxvnni"}),
                   _target("alderlake"), "AVX2 + AVX-VNNI: vpshufb ymm, vpdpbusd ymm", vector_registers=16, vnni=True,
                   **STREAM)
AVX2 = X86Isa("avx2", "x86_64", 32, frozenset({"avx2"}),
              _target("haswell"), "AVX2: vpshufb ymm, vpmaddubsw/vpmaddwd", vector_registers=16, **STREAM)
