"""NVFP4 GEMV for one or a few activation rows on Hopper, through Pallas's Mosaic GPU backend.

y [M, N] = x [M, K] W^T for an NVFP4 weight (`quant_formats.QuantizedWeight`, format "nvfp4"), M at
most MAX_ROWS; the dispatcher sends it one or two rows (`TunedTilings.mosaic_gemv_rows` in
quant_matmul.py; more go to the tensor-core kernel, nvfp4_mma_mosaic.py). The Triton packed-half
GEMV (quant_half_gemv.py) keeps the next K step's tiles in registers (Triton issues no asynchronous
copies for them) and needs a row kernel launched first. Here the weight codes, group scales and
the step's activations stream into shared memory through the Hopper TMA unit, `stages` K steps
ahead (`plgpu.emit_pipeline`), and each CTA prepares its own activations. On the H200 it is faster
than the Triton kernel with its row kernel at every 27B and 0.8B shape measured (BENCHMARKS.md).

One CTA (one warpgroup, 128 threads) per box of bn output rows; for long rows a whole number of CTAs
an SM, where neighbouring boxes may overlap (`sm_balanced`, `first_row`), so that every SM streams the
same bytes:
  - each K step (`_step_products`) takes groups x 512 values of the bn rows. A lane owns one 16-value
    group of the step: for each activation row it scales the group's activations by a power of two
    (`_group_pairs`: the group's largest |x| into [2^14, 2^15), so no sum of 16 products leaves f16)
    and pairs them as quant_half_gemv's NVFP4 PTX meets them; it decodes each of its rows' two weight
    words once (`_DECODE_PTX`) and runs the products (eight fma.f16x2, `_SUM_PTX`) for every
    activation row, adding the sum times the group scale times 2^-shift to a float32 accumulator;
  - after the last step (`_store_rows`) the lanes (and warps) sharing a row add up and write y.
The decode and products are quant_half_gemv's PTX (`half_word_sums` is their CPU form); the scaling is
per group here, per row there. Mosaic GPU has no CPU interpreter for inline PTX, so this kernel runs
on a GPU only; on the CPU its tests check that it lowers, and bench/kernels.py checks its numbers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector

from pallas_kernels.mosaic_ir import const, element, i32, as_index, inline_asm, lane_and_warp, scaled_pairs, x_tops
from pallas_kernels.quant_formats import (E2M1_SHRINK, GROUP, X_PAIR_VALUES, nvfp4_decode_ptx,
                                          nvfp4_sum_ptx)

WORDS_A_GROUP = GROUP // 8  # e2m1 weight words (8 values each) a group
PAIRS_A_GROUP = 2 * len(X_PAIR_VALUES["nvfp4"])  # activation pair words a group: 4 arrays x 2 weight words
_E4M3_TO_F32_PTX = ("{\n.reg .b16 l;\n.reg .b32 h;\n.reg .f16 a, b;\n"
                    "cvt.u16.u32 l, $1; cvt.rn.f16x2.e4m3x2 h, l; mov.b32 {a, b}, h; cvt.f32.f16 $0, a;\n}")
MAX_ROWS = 8  # activation rows a call: one accumulator per (activation row, weight row) in registers
# quant_half_gemv's NVFP4 PTX split in two, so that each weight word pair is decoded once for all activation
# rows: $0-$7 the eight f16 pairs from words $8 $9; then per activation row, $0 = $18 + the group's sum
# of halves $1-$8 times pairs $9-$16 (A0 A1 B0 B1 C0 C1 D0 D1), times scale $17
_HALVES = [f"${i}" for i in range(8)]
_DECODE_PTX = "{\n.reg .b32 t, u;\n" + nvfp4_decode_ptx(("$8", "$9"), _HALVES) + "\n}"
_DECODE_CONSTRAINTS = ",".join(["=r"] * 8 + ["r"] * 2)
_SUM_PTX = ("{\n.reg .b32 p;\n.reg .f16 a, b;\n.reg .f32 fa;\n"
            + nvfp4_sum_ptx([f"${i}" for i in range(1, 9)], [f"${i}" for i in range(9, 17)])
            + " cvt.f32.f16 fa, a; fma.rn.f32 $0, fa, $17, $18;\n}")
_SUM_CONSTRAINTS = ",".join(["=f"] + ["r"] * (8 + PAIRS_A_GROUP) + ["f"] * 2)


def _group_pairs(x_step, m: int, half, lane) -> tuple[list, ir.Value]:
    """Group 32 half + lane of a K step of activation row m from x_step [M, groups, 256] i32 (SMEM, the
    step's bf16 values two a word, 512 a TMA box row), scaled by its own power of two (`scaled_pairs`)
    -> (its activation pair words in the PTX's operand order: array A of the group's two weight words,
    then B, C, D; 2^-shift f32)."""
    at = [as_index(const(m)), as_index(half), as_index(arith.muli(lane, const(8)))]
    words = vector.load(ir.VectorType.get((8,), i32()), x_step, at)
    words = [element(words, i) for i in range(8)]
    pairs, unscale = scaled_pairs(words, x_tops(words))
    return [pairs[word][i] for i in range(len(X_PAIR_VALUES["nvfp4"])) for word in range(WORDS_A_GROUP)], unscale


def rows_fit(N: int, bn: int, ctas: int) -> bool:
    """Whether CTAs of bn weight rows cover N rows: N / bn CTAs of their own rows (ctas 0), or `ctas`
    CTAs, CTA c at row min(c N // ctas, N - bn) (`first_row`), whose boxes may overlap."""
    return N % bn == 0 if ctas == 0 else bn <= N <= bn * ctas


def first_row(cta, N: int, bn: int, ctas: int):
    """The first weight row of CTA `cta` (traced i32). With a multiple of the SM count as `ctas`, every
    SM gets the same rows to stream however N divides; where two boxes overlap, both CTAs compute the
    shared rows the same way and store the same values."""
    return jnp.minimum(cta * N // ctas, N - bn) if ctas else cta * bn


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    """bn output rows a CTA; each K step takes `groups` x 512 values (lane l of warp w owns group
    l + 32 (w % groups) of the step, in rows w // groups + (4 / groups) r); `stages` steps in flight;
    `ctas` CTAs (0: N / bn, each its own rows)."""

    bn: int = 16
    groups: int = 1
    stages: int = 4
    ctas: int = 0  # see `rows_fit`

    @property
    def block_k(self) -> int:
        return self.groups * 32 * GROUP

    @property
    def rows_a_thread(self) -> int:
        return self.bn * self.groups // 4

    def fits(self, N: int, K: int) -> bool:
        return (rows_fit(N, self.bn, self.ctas) and K % self.block_k == 0 and 4 % self.groups == 0
                and self.rows_a_thread >= 1)

    def thread_rows(self, warp) -> list:
        """The rows (i32) a thread of `warp` owns, one a register of its accumulator."""
        first = arith.divui(warp, const(self.groups))
        return [arith.addi(first, const(4 // self.groups * r)) for r in range(self.rows_a_thread)]


def sm_balanced(N: int, sm_count: int, rows: int, multiple: int) -> tuple[int, int] | None:
    """(ctas, bn) for N weight rows: the multiple of sm_count CTAs nearest to N / rows, each bn rows
    (N / ctas rounded up to a multiple of `multiple`; neighbours' boxes overlap by what that rounding
    adds), or None where N is under half a CTA an SM. A whole number of CTAs an SM gives every SM the
    same bytes to stream; with N / bn CTAs a few SMs take one CTA more than the rest and set the
    kernel's time."""
    per_sm = round(N / (sm_count * rows))
    if per_sm == 0:
        return None
    ctas = per_sm * sm_count
    bn = -(-N // ctas)
    return ctas, bn + -bn % multiple


ROWS_A_THREAD = 10  # weight rows a thread of the f16x2 kernel, about: each activation group it scales serves them all
BALANCED_STEPS = 8  # K steps a row needs before SM-balanced grids pay off in the f16x2 kernel (measured, below)


def pick_mosaic_tiling(N: int, K: int, sm_count: int) -> MosaicTiling | None:
    """The measured tiling for an NVFP4 weight [N, K] on a GPU of `sm_count` SMs, or None where it does
    not fit (then the Triton kernel runs, quant_matmul_triton.py): 512 values a step (one group a lane), or 1024 for
    rows of 8192 values or more; for rows of BALANCED_STEPS steps or more, a whole number of CTAs an
    SM, about ROWS_A_THREAD rows a thread (`sm_balanced`), with 4 stages at 1024 values a step, else 3,
    or 2 where three CTAs or more share an SM; for shorter rows or under half a CTA an SM, N / bn CTAs
    of 16 rows, or 8 where that would leave SMs without one. Each choice was the fastest of those
    timed on the H200 with cold weights at the 27B and 0.8B projection shapes; rows of fewer steps
    do not gain from balanced grids (BENCHMARKS.md)."""
    groups = 2 if K >= 8192 else 1
    steps = K // (groups * 32 * GROUP)
    balanced = sm_balanced(N, sm_count, ROWS_A_THREAD * 4 // groups, 4 // groups) if steps >= BALANCED_STEPS else None
    if balanced is None:
        t = MosaicTiling(16 if N // 16 >= sm_count else 8, groups, 4)
    else:
        ctas, bn = balanced
        if groups == 2:
            stages = 4
        else:
            stages = 2 if ctas >= 3 * sm_count else 3
        t = MosaicTiling(bn, groups, stages, ctas)
    return t if t.fits(N, K) else None


def _step_products(t: MosaicTiling, rows: int, codes, scales, x_step, acc):
    """acc [rows bn groups, 32] f32 (register m R + r of a thread, R = t.rows_a_thread: activation row m,
    weight row t.thread_rows()[r], its lane's group) plus one K step's products: codes [bn, block_k/8]
    i32, scales [bn, block_k/16] i8 (e4m3), x_step [rows, groups, 256] i32, all SMEM."""
    lane, warp = lane_and_warp()
    f32 = ir.F32Type.get()
    half = arith.remui(warp, const(t.groups))
    group = arith.addi(lane, arith.muli(half, const(32)))
    x_groups = [_group_pairs(x_step, m, half, lane) for m in range(rows)]
    registers = np.empty_like(acc.registers)
    R = t.rows_a_thread
    for r, row in enumerate(t.thread_rows(warp)):
        row = as_index(row)
        words = vector.load(ir.VectorType.get((WORDS_A_GROUP,), i32()), codes,
                            [row, as_index(arith.muli(group, const(2)))])
        halves = inline_asm([i32()] * 8, _DECODE_PTX, _DECODE_CONSTRAINTS, [element(words, 0), element(words, 1)])
        scale_byte = arith.extui(i32(), memref.load(scales, [row, as_index(group)]))
        [scale] = inline_asm([f32], _E4M3_TO_F32_PTX, "=f,r", [scale_byte])
        for m, (x_words, unscale) in enumerate(x_groups):
            old = element(acc.registers[m * R + r], 0)
            [new] = inline_asm([f32], _SUM_PTX, _SUM_CONSTRAINTS, [*halves, *x_words, arith.mulf(scale, unscale), old])
            registers[m * R + r] = vector.from_elements(ir.VectorType.get((1,), f32), [new])
    return mgpu.FragmentedArray(_registers=registers, _layout=acc.layout, _is_signed=None)


def _store_rows(t: MosaicTiling, rows: int, acc, out, global_scale, partials):
    """out [rows, bn] (GMEM, x's dtype) = each row's sum of its lanes and groups times the global scale
    x 2^14 (the decode's 2^-14 undone). A warp's lanes add by shuffles; with more than one group a step
    the warps sharing a row meet in partials [rows, bn, groups] f32 (SMEM). Threads storing the same
    value to one address make one transaction."""
    f32 = ir.F32Type.get()
    lane, warp = lane_and_warp()
    factor = arith.mulf(memref.load(global_scale, [as_index(const(0))]), arith.constant(f32, E2M1_SHRINK))
    out_type = ir.MemRefType(out.type).element_type
    R = t.rows_a_thread
    for m in range(rows):
        for r, row in enumerate(t.thread_rows(warp)):
            total = element(acc.registers[m * R + r], 0)
            for distance in (16, 8, 4, 2, 1):
                total = arith.addf(total, mgpu_utils.shfl_bfly(total, distance))
            if t.groups == 1:
                memref.store(arith.truncf(out_type, arith.mulf(total, factor)), out,
                             [as_index(const(m)), as_index(row)])
            else:
                memref.store(total, partials,
                             [as_index(const(m)), as_index(row), as_index(arith.remui(warp, const(t.groups)))])
    if t.groups > 1:
        mgpu_utils.warpgroup_barrier()
        row = arith.remui(mgpu_utils.thread_idx(), const(t.bn))
        for m in range(rows):
            def at(gi):
                return [as_index(const(m)), as_index(row), as_index(const(gi))]
            total = memref.load(partials, at(0))
            for gi in range(1, t.groups):
                total = arith.addf(total, memref.load(partials, at(gi)))
            memref.store(arith.truncf(out_type, arith.mulf(total, factor)), out, [as_index(const(m)), as_index(row)])


# ----------------------------------------------------------------------------- the kernel


def streamed_nvfp4_kernel(name: str, x: jax.Array, data: jax.Array, scale: jax.Array, global_scale: jax.Array, *,
                          tiling, max_rows: int, acc_shape: tuple, partials_shape: tuple, step_products,
                          store_rows) -> jax.Array:
    """The TMA pipeline both Mosaic GPU NVFP4 kernels run (x [M, K] bf16, the weight as in
    `nvfp4_gemv_mosaic` -> [M, N] bf16): each CTA (tiling.ctas, or N / bn; its rows from `first_row`)
    streams the codes of its bn output rows [bn, block_k/8]
    i32, group scales [bn, block_k/16] u8 and the step's activations [M, block_k/512, 256] i32 (bf16
    pairs; TMA boxes stop at 256 a side) into shared memory, `stages` K steps ahead (bn, block_k,
    stages and fits(N, K) from `tiling`; M at most max_rows).
    `step_products(codes, scales, x_step, acc)` adds one step into acc (float32 `acc_shape`,
    WG_STRIDED), then `store_rows(acc, out [M, bn], global_scale [1], partials)` writes the CTA's
    outputs, partials being float32 `partials_shape` shared memory. `name` names the GPU kernel."""
    N, K = data.shape[0], 2 * data.shape[1]
    M, bn, block_k = x.shape[0], tiling.bn, tiling.block_k
    if x.ndim != 2 or x.shape[1] != K or not 1 <= M <= max_rows or x.dtype != jnp.bfloat16:
        raise ValueError(f"{name}_mosaic takes 1 to {max_rows} bf16 rows [M, {K}] for a [{N}, {K}] weight, "
                         f"got {x.dtype} {list(x.shape)}")
    if not tiling.fits(N, K):
        raise ValueError(f"{tiling} does not fit an NVFP4 weight [{N}, {K}]: its CTAs must cover N rows (`rows_fit`) "
                         f"and K divide by {block_k}")
    words = jax.lax.bitcast_convert_type(data.reshape(N, K // 8, 4), jnp.int32)
    scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8)
    acc_layout = plgpu.Layout.WG_STRIDED(acc_shape, vec_size=1)
    ref = plgpu.RefType()
    products = plgpu.inline_mgpu(arg_types=(ref, ref, ref, acc_layout),
                                 return_type=plgpu.ShapeDtypeStruct(acc_shape, jnp.float32, layout=acc_layout))(
        lambda ctx, *args: step_products(*args))
    store = plgpu.inline_mgpu(arg_types=(acc_layout, ref, ref, ref))(lambda ctx, *args: store_rows(*args))

    def body(x_gmem, w_gmem, s_gmem, g_gmem, o_gmem, partials):
        rows = pl.ds(first_row(jax.lax.axis_index("n"), N, bn, tiling.ctas), bn)
        acc = plgpu.emit_pipeline(
            lambda indices, codes, scales, x_step, acc: products(codes, scales, x_step, acc),
            grid=(K // block_k,), max_concurrent_steps=tiling.stages,
            in_specs=[plgpu.BlockSpec((bn, block_k // 8), lambda k: (0, k)),
                      plgpu.BlockSpec((bn, block_k // GROUP), lambda k: (0, k)),
                      plgpu.BlockSpec((M, block_k // 512, 256), lambda k: (0, k, 0))],
            init_carry=plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), acc_layout),
        )(w_gmem.at[rows], s_gmem.at[rows], x_gmem)
        store(acc, o_gmem.at[:, rows], g_gmem, partials)

    body.__name__ = name
    x_rows = jax.lax.bitcast_convert_type(x.reshape(M, K // 512, 256, 2), jnp.int32)
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((M, N), x.dtype), grid=(tiling.ctas or N // bn,), grid_names=("n",),
        scratch_types=dict(partials=plgpu.SMEM(partials_shape, jnp.float32)),
    )(x_rows, words, scale_bytes, jnp.reshape(global_scale, (1,)).astype(jnp.float32))


def nvfp4_gemv_mosaic(x: jax.Array, data: jax.Array, scale: jax.Array, global_scale: jax.Array,
                      tiling: MosaicTiling = MosaicTiling()) -> jax.Array:
    """x [M, K] bf16 (M at most MAX_ROWS), data [N, K/2] uint8 (E2M1_BITS layout), scale [N, K/16]
    float8_e4m3fn, global_scale [] float32 -> x W^T [M, N] bf16. `tiling.fits(N, K)` must hold; a GPU
    with TMA (Hopper)."""
    M, t = x.shape[0], tiling
    return streamed_nvfp4_kernel(
        "nvfp4_gemv", x, data, scale, global_scale, tiling=t, max_rows=MAX_ROWS,
        acc_shape=(M * t.bn * t.groups, 32), partials_shape=(M, t.bn, t.groups),
        step_products=lambda *refs: _step_products(t, M, *refs), store_rows=lambda *refs: _store_rows(t, M, *refs))
