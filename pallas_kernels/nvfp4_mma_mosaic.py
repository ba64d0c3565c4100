"""NVFP4 x [M, K] W^T for 3-16 activation rows on Hopper: tensor-core products, Pallas Mosaic GPU.

nvfp4_gemv_mosaic.py multiplies each decoded weight pair with each activation row in f16x2 FMAs, so
its time grows by about a third of a one-row call for every row. Here the decoded weights go through
`mma.sync.m16n8k16` (f16 in, f32 sums): the tensor cores take the rows, and a call costs nearly the
same at any M. At one or two rows the f16x2 kernel is faster, so the dispatcher sends this one 3-16
rows. Up to 8 rows fill the MMA's rows 0-7; 9-16 fill rows 8-15 too, which doubles the activations'
work. A whole number of CTAs an SM (`pick_mma_tiling`) keeps every SM streaming. Figures:
BENCHMARKS.md, "Weight-only quantized matmuls".

The weights stream through a TMA ring (`plgpu.emit_pipeline`) as in nvfp4_gemv_mosaic.py, with the
step's activations. One CTA (4 warps) per bn = 8 x n_tiles weight rows; the warps split each K
step: warp w, chunk c take values [(4c + w) 128, +128). Lane (g, t) (g = lane // 4, t = lane % 4)
owns 4 weight words (32 values at +32t) of rows 8j + g of each n-tile j, and the same 32 values of
activation row g (row M - 1 where g >= M: its results are dropped). For each word:
  - the decode is quant_half_gemv's NVFP4 PTX (`nvfp4_decode_ptx`): four f16 pairs, values (0, 4),
    (2, 6), (7, 3), (5, 1), each times 2^-14;
  - the group's e4m3 scale multiplies them in f16 (`_SCALE_PAIR_PTX`; every product of an e2m1
    value, an e4m3 scale and 2^-14 is an f16 with no rounding);
  - two MMAs take them as the B operand's k pairs t and t + 4 (column g), against the activation
    pairs of the same values as the A operand's (row g). The k order inside an MMA is free, so it
    is the decode's.
The activations are scaled by a power of two per quad and chunk (`_x_pairs`: the quad's largest
|x| into [2^14, 2^15), as nvfp4_gemv_mosaic.py does per group), so small rows keep their bits in
f16; each chunk's sums are scaled back as they are added to float32 accumulators. After the K loop
the warps' partial sums meet in shared memory (`_store_rows`).
Mosaic GPU has no CPU interpreter for inline PTX: on the CPU the tests check that it lowers;
bench/kernels.py checks its numbers on the GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, scf, vector

from pallas_kernels.mosaic_ir import const, element, i32, as_index, inline_asm, lane_and_warp, scaled_pairs, x_tops
from pallas_kernels.nvfp4_gemv_mosaic import rows_fit, sm_balanced, streamed_nvfp4_kernel
from pallas_kernels.quant_formats import E2M1_SHRINK, nvfp4_decode_ptx

MAX_ROWS = 16  # activation rows a call: the MMA's 16 (with 8 or fewer, its rows 8-15 multiply zeros)
WARPS = 4
CHUNK = 128  # values of a K step a warp takes at a time: 4 lanes x 4 words x 8
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def _word_ptx(halves: int) -> str:
    """One weight word of a lane: $0-$3 = C + two MMAs. $4 the word, $5 its group scale as an f16 pair,
    $6-$9 activation row g's pairs of the word's values (0, 4), (2, 6), (7, 3), (5, 1), then (with two
    halves) row g + 8's, then C. A's fragment is (row g, k pair t), (row g + 8, t), (g, t + 4),
    (g + 8, t + 4); B's is k pairs t, t + 4 of column g."""
    rows = [[f"${6 + 4 * h + i}" for i in range(4)] for h in range(halves)] + [["z"] * 4] * (2 - halves)
    c = ",".join(f"${6 + 4 * halves + i}" for i in range(4))
    def a(i, j):
        return f"{{{rows[0][i]},{rows[1][i]},{rows[0][j]},{rows[1][j]}}}"
    return ("{\n.reg .b32 t, u, z, h<4>;\nmov.b32 z, 0;\n"
            + nvfp4_decode_ptx(("$4",), [f"h{i}" for i in range(4)]) + "\n"
            + " ".join(f"mul.f16x2 h{i}, h{i}, $5;" for i in range(4)) + "\n"
            + f"{_MMA} {{$0,$1,$2,$3}}, {a(0, 1)}, {{h0,h1}}, {{{c}}};\n"
            + f"{_MMA} {{$0,$1,$2,$3}}, {a(2, 3)}, {{h2,h3}}, {{$0,$1,$2,$3}};\n}}")


_WORD_PTX = {halves: (_word_ptx(halves), ",".join(["=f"] * 4 + ["r"] * (2 + 4 * halves) + ["f"] * 4))
             for halves in (1, 2)}
# An e4m3 byte -> the f16 pair (scale, scale): the byte twice, then one conversion.
_SCALE_PAIR_PTX = ("{\n.reg .b32 r;\n.reg .b16 l;\n"
                   "mul.lo.u32 r, $1, 257; cvt.u16.u32 l, r; cvt.rn.f16x2.e4m3x2 $0, l;\n}")


@dataclasses.dataclass(frozen=True)
class MmaTiling:
    """bn = 8 n_tiles weight rows a CTA; each K step takes `chunks` x 512 values (each warp one CHUNK
    of each 512); `stages` steps in flight."""

    bn: int = 32
    chunks: int = 1
    stages: int = 3
    ctas: int = 0  # as MosaicTiling's

    @property
    def block_k(self) -> int:
        return self.chunks * WARPS * CHUNK

    @property
    def n_tiles(self) -> int:
        return self.bn // 8

    def fits(self, N: int, K: int) -> bool:
        return self.bn % 8 == 0 and rows_fit(N, self.bn, self.ctas) and K % self.block_k == 0


MMA_ROWS = 44  # weight rows a CTA of the tensor-core kernel, about: the fastest range timed on the H200


def pick_mma_tiling(N: int, K: int, sm_count: int) -> MmaTiling | None:
    """The measured tiling for an NVFP4 weight [N, K] on a GPU of `sm_count` SMs, or None where it does
    not fit: 512 values a step, 1024 for rows of 8192 values or more; 3 stages; a whole number of CTAs
    an SM of about MMA_ROWS rows (`sm_balanced`), else N / 8 CTAs of 8 rows where that makes at most
    one an SM, else N / 32 of 32. Each choice was the fastest of those timed on the H200 with cold
    weights at the 27B and 0.8B projection shapes, at 4 and 8 activation rows (BENCHMARKS.md)."""
    chunks = 2 if K >= 8192 else 1
    balanced = sm_balanced(N, sm_count, MMA_ROWS, 8)
    if balanced is not None:
        ctas, bn = balanced
        t = MmaTiling(bn, chunks, 3, ctas)
    elif N // 8 <= sm_count:
        t = MmaTiling(8, 1, 4)
    else:
        t = MmaTiling(32, chunks, 3)
    return t if t.fits(N, K) else None


def _x_pairs(x_step, M: int, chunk: int, warp, g, t, half: int) -> tuple[list, ir.Value]:
    """Lane (g, t)'s activation row of MMA row g + 8 half (min(g + 8 half, M - 1): rows past M are
    dropped) at its 32 values of `chunk` from x_step [M, chunks, 256] i32 (SMEM, bf16 pairs) -> (per
    weight word its four f16 pairs, 2^-shift). The shift is the quad's: its four lanes' values meet in
    one MMA row, so they share one power of two."""
    row = as_index(arith.minui(arith.addi(g, const(8 * half)), const(M - 1)))
    first = arith.addi(arith.muli(warp, const(CHUNK // 2)), arith.muli(t, const(16)))
    words = []
    for q in range(4):
        v = vector.load(ir.VectorType.get((4,), i32()), x_step,
                        [row, as_index(const(chunk)), as_index(arith.addi(first, const(4 * q)))])
        words += [element(v, i) for i in range(4)]
    tops = x_tops(words)
    for distance in (1, 2):
        [tops] = inline_asm([i32()], "max.u16x2 $0, $1, $2;", "=r,r,r", [tops, mgpu_utils.shfl_bfly(tops, distance)])
    return scaled_pairs(words, tops)


def _lane_parts():
    lane, warp = lane_and_warp()
    return arith.shrui(lane, const(2)), arith.andi(lane, const(3)), warp


def _halves(rows: int) -> int:
    """The MMA row blocks of 8 that hold activation rows."""
    return 1 if rows <= 8 else 2


def _step_products(t: MmaTiling, rows: int, codes, scales, x_step, acc):
    """acc [8 n_tiles halves, 32] f32 (register 2 halves j + 2 h + e of lane (g, t): activation row
    g + 8h, weight row 8j + 2t + e) plus one K step's products: codes [bn, block_k/8] i32, scales
    [bn, block_k/16] i8 (e4m3), x_step [rows, chunks, 256] i32, all SMEM."""
    g, lane_t, warp = _lane_parts()
    f32 = ir.F32Type.get()
    halves = _halves(rows)
    ptx, constraints = _WORD_PTX[halves]
    registers = list(acc.registers.flat)
    for chunk in range(t.chunks):
        x_rows = [_x_pairs(x_step, rows, chunk, warp, g, lane_t, h) for h in range(halves)]
        word = arith.addi(arith.muli(arith.addi(const(WARPS * chunk), warp), const(CHUNK // 8)),
                          arith.muli(lane_t, const(4)))
        for j in range(t.n_tiles):
            row = as_index(arith.addi(const(8 * j), g))
            words = vector.load(ir.VectorType.get((4,), i32()), codes, [row, as_index(word)])
            scale_bytes = vector.load(ir.VectorType.get((2,), ir.IntegerType.get_signless(8)), scales,
                                      [row, as_index(arith.shrui(word, const(1)))])
            scale_pairs = [inline_asm([i32()], _SCALE_PAIR_PTX, "=r,r",
                                      [arith.extui(i32(), element(scale_bytes, i))])[0]
                           for i in range(2)]
            sums = [arith.constant(f32, 0.0)] * 4
            for k in range(4):  # the lane's words; two a group
                x_pairs = [pair for pairs, _ in x_rows for pair in pairs[k]]
                sums = inline_asm([f32] * 4, ptx, constraints,
                                  [element(words, k), scale_pairs[k // 2], *x_pairs, *sums])
            for h, (_, unscale) in enumerate(x_rows):
                for e in range(2):
                    r = 2 * halves * j + 2 * h + e
                    new = arith.addf(element(registers[r], 0), arith.mulf(sums[2 * h + e], unscale))
                    registers[r] = vector.from_elements(ir.VectorType.get((1,), f32), [new])
    registers = np.array(registers, dtype=object).reshape(acc.registers.shape)
    return mgpu.FragmentedArray(_registers=registers, _layout=acc.layout, _is_signed=None)


def _store_rows(t: MmaTiling, rows: int, acc, out, global_scale, partials):
    """out [rows, bn] (GMEM, x's dtype) = the warps' sums times the global scale x 2^14 (the decode's
    2^-14 undone); they meet in partials [WARPS, 8 halves, bn] f32 (SMEM)."""
    f32 = ir.F32Type.get()
    g, lane_t, warp = _lane_parts()
    halves = _halves(rows)
    registers = list(acc.registers.flat)
    for j in range(t.n_tiles):
        for h in range(halves):
            for e in range(2):
                column = arith.addi(const(8 * j + e), arith.muli(lane_t, const(2)))
                memref.store(element(registers[2 * halves * j + 2 * h + e], 0), partials,
                             [as_index(warp), as_index(arith.addi(g, const(8 * h))), as_index(column)])
    mgpu_utils.warpgroup_barrier()
    factor = arith.mulf(memref.load(global_scale, [as_index(const(0))]), arith.constant(f32, E2M1_SHRINK))
    out_type = ir.MemRefType(out.type).element_type
    for i in range(-(-rows * t.bn // (WARPS * 32))):  # each thread one (row, output) a round
        index = arith.addi(mgpu_utils.thread_idx(), const(WARPS * 32 * i))
        m, n = as_index(arith.divui(index, const(t.bn))), as_index(arith.remui(index, const(t.bn)))
        inside = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, index, const(rows * t.bn)))
        with ir.InsertionPoint(inside.then_block):
            total = memref.load(partials, [as_index(const(0)), m, n])
            for w in range(1, WARPS):
                total = arith.addf(total, memref.load(partials, [as_index(const(w)), m, n]))
            memref.store(arith.truncf(out_type, arith.mulf(total, factor)), out, [m, n])
            scf.yield_([])


def nvfp4_mma_mosaic(x: jax.Array, data: jax.Array, scale: jax.Array, global_scale: jax.Array,
                     tiling: MmaTiling = MmaTiling()) -> jax.Array:
    """x [M, K] bf16 (M at most MAX_ROWS), data [N, K/2] uint8 (E2M1_BITS layout), scale [N, K/16]
    float8_e4m3fn, global_scale [] float32 -> x W^T [M, N] bf16. `tiling.fits(N, K)` must hold (bn a
    multiple of 8); a GPU with TMA (Hopper)."""
    M, t = x.shape[0], tiling
    rows_8 = 8 * _halves(M)  # MMA rows in use; the accumulator has two registers a thread for each 8 and n-tile
    return streamed_nvfp4_kernel(
        "nvfp4_mma", x, data, scale, global_scale, tiling=t, max_rows=MAX_ROWS,
        acc_shape=(rows_8 * t.n_tiles, 32), partials_shape=(WARPS, rows_8, t.bn),
        step_products=lambda *refs: _step_products(t, M, *refs), store_rows=lambda *refs: _store_rows(t, M, *refs))
