"""NVFP4 GEMV for one activation row on Hopper, through Pallas's Mosaic GPU backend.

y [1, N] = x [1, K] W^T for an NVFP4 weight (`quant_matmul.QuantizedWeight`, format "nvfp4").
quant_matmul's Triton kernel keeps the next K step's tiles in registers (Triton issues no
asynchronous copies for them) and needs a row kernel launched first. Here the weight codes and group
scales stream into shared memory through the Hopper TMA unit, `stages` K steps ahead
(`plgpu.emit_pipeline`), and each CTA prepares its own activations. H200, cold weights, session 11
(BENCHMARKS.md): a 27B MLP matrix [17408, 5120] in 16.8-17.2 us against 17.4 for Triton with its row
kernel, [5120, 17408] in 17.2 against 18.8, 0.8B projections 20-30% faster; a 0.8B NVFP4 decode step
1.37 ms of GPU time against 1.93.

One CTA (one warpgroup, 128 threads) per block of bn output rows:
  - the whole row x lands in shared memory by one TMA copy, beside the weights' ring;
  - each K step (`_step_products`) takes groups x 512 values of the bn rows. A lane owns one
    16-value group of the step: it scales the group's activations by a power of two (`_group_pairs`:
    the group's largest |x| into [2^14, 2^15), so no sum of 16 products leaves f16), pairs them as
    quant_matmul's NVFP4 PTX meets them, and runs that PTX on each of its rows' two weight words (eight
    fma.f16x2), adding the sum times the group scale times 2^-shift to a float32 accumulator;
  - after the last step (`_store_rows`) the lanes (and warps) sharing a row add up and write y.
The decode and products are quant_matmul's PTX (`half_word_sums` is their CPU form); the scaling is
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
from jaxlib.mlir.dialects import arith, llvm, memref, vector

from pallas_kernels.quant_matmul import _NVFP4_HALF_PTX, E2M1_SHRINK, FEW_PROGRAMS, GROUP, X_PAIR_VALUES, X_TOP_EXPONENT

WORDS_A_GROUP = GROUP // 8  # e2m1 weight words (8 values each) a group
PAIRS_A_GROUP = 2 * len(X_PAIR_VALUES["nvfp4"])  # activation pair words a group: 4 arrays x 2 weight words
_E4M3_TO_F32_PTX = ("{\n.reg .b16 l;\n.reg .b32 h;\n.reg .f16 a, b;\n"
                    "cvt.u16.u32 l, $1; cvt.rn.f16x2.e4m3x2 h, l; mov.b32 {a, b}, h; cvt.f32.f16 $0, a;\n}")
# quant_matmul's NVFP4 PTX: two results (Triton packs two words a call), the words, the activation pairs,
# the scale and the accumulator twice each
_PRODUCTS_CONSTRAINTS = ",".join(["=f,=f"] + ["r"] * (2 + PAIRS_A_GROUP) + ["f"] * 4)


# ----------------------------------------------------------------------------- MLIR helpers


def _i32():
    return ir.IntegerType.get_signless(32)


def _c(value: int):
    return mgpu_utils.c(value, _i32())


def _index(value):
    return arith.index_cast(ir.IndexType.get(), value)


def _element(vec, i: int):
    return vector.extract(vec, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))


def _lane_and_warp():
    t = mgpu_utils.thread_idx()
    return arith.andi(t, _c(31)), arith.shrui(t, _c(5))


def _as_f32(bits):
    return arith.bitcast(ir.F32Type.get(), bits)


def _power_of_two(e):
    """2^e as float32 from its bits, e i32 in [-126, 127]."""
    return _as_f32(arith.shli(arith.addi(e, _c(127)), _c(23)))


def _asm(result_types: list, text: str, constraints: str, args: list) -> list:
    if len(result_types) == 1:
        return [llvm.inline_asm(result_types[0], args, text, constraints)]
    struct = llvm.StructType.get_literal(result_types)
    out = llvm.inline_asm(struct, args, text, constraints)
    return [llvm.extractvalue(t, out, [i]) for i, t in enumerate(result_types)]


# ----------------------------------------------------------------------------- one thread's code (inline Mosaic GPU)


_GROUP_TOP_PTX = "{\n.reg .b32 m;\nand.b32 m, $1, 0x7FFF7FFF; max.u16x2 $0, $2, m;\n}"  # two bf16 |x| a word, apart


def _group_pairs(x_step, half, lane) -> tuple[list, ir.Value]:
    """Group 32 half + lane of a K step from x_step [groups, 256] i32 (SMEM, the step's bf16 values two
    a word, 512 a row: TMA boxes stop at 256) -> (its activation pair words in the PTX's operand order:
    array A of the group's two weight words, then B, C, D (`X_PAIR_VALUES`); 2^-shift f32). Each value
    is scaled by 2^shift, which brings the group's largest |x| into [2^14, 2^15) (`X_TOP_EXPONENT`):
    no sum of 16 products leaves f16's range, and small values keep their bits."""
    words = vector.load(ir.VectorType.get((8,), _i32()), x_step, [_index(half), _index(arith.muli(lane, _c(8)))])
    words = [_element(words, i) for i in range(8)]
    tops = _c(0)
    for w in words:
        [tops] = _asm([_i32()], _GROUP_TOP_PTX, "=r,r,r", [w, tops])
    top = arith.maxui(arith.andi(tops, _c(0xFFFF)), arith.shrui(tops, _c(16)))  # the largest |x|'s bf16 bits
    biased = arith.shrui(top, _c(7))  # its exponent field: |x| = m 2^(biased - 126), m in [0.5, 1)
    shift = arith.maxsi(arith.minsi(arith.subi(_c(X_TOP_EXPONENT["nvfp4"] + 126), biased), _c(126)), _c(-126))
    scale = _power_of_two(shift)
    values = []  # the group's 16 values, scaled: value 2m is word m's low half, 2m + 1 its high half
    for w in words:
        values += [arith.mulf(_as_f32(bits), scale) for bits in (arith.shli(w, _c(16)), arith.andi(w, _c(-65536)))]
    pair = lambda low, high: _asm([_i32()], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [high, low])[0]  # high lane first
    pairs = [pair(values[8 * word + low], values[8 * word + high])
             for low, high in X_PAIR_VALUES["nvfp4"] for word in range(WORDS_A_GROUP)]
    return pairs, _power_of_two(arith.subi(_c(0), shift))


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    """bn output rows a CTA; each K step takes `groups` x 512 values (lane l of warp w owns group
    l + 32 (w % groups) of the step, in rows w // groups + (4 / groups) r); `stages` steps in flight."""

    bn: int = 16
    groups: int = 1
    stages: int = 4

    @property
    def block_k(self) -> int:
        return self.groups * 32 * GROUP

    @property
    def rows_a_thread(self) -> int:
        return self.bn * self.groups // 4

    def fits(self, N: int, K: int) -> bool:
        divides = N % self.bn == 0 and K % self.block_k == 0 and 4 % self.groups == 0 and self.rows_a_thread >= 1
        return divides and K <= 256 * 512  # the row is one TMA box of [K / 512, 256] words

    def thread_rows(self, warp) -> list:
        """The rows (i32) a thread of `warp` owns, one a register of its accumulator."""
        first = arith.divui(warp, _c(self.groups))
        return [arith.addi(first, _c(4 // self.groups * r)) for r in range(self.rows_a_thread)]


def pick_mosaic_tiling(N: int, K: int, sm_count: int) -> MosaicTiling | None:
    """The measured tiling for an NVFP4 weight [N, K] on a GPU of `sm_count` SMs, or None where it does
    not fit (then quant_matmul's Triton kernel runs). H200, cold weights (session 11, BENCHMARKS.md):
      - many rows (N / 16 at least FEW_PROGRAMS: [17408, 5120]): 32 rows, 3 stages, 16.8 us; 16 rows
        took 19.2, 64 rows 17.7, 4 stages 18.2 (Triton 17.4);
      - fewer rows: 16 rows, 4 stages, and for rows of 8192 values or more 1024 a step (two groups a
        lane): [5120, 17408] 17.2 us, against 20.6 with one group and 18.9 with 32 rows (Triton 18.8);
        under one CTA an SM at 16 rows, 8 rows ([1024, 3584]: 3.1 against 3.3 us; Triton 4.5)."""
    if N // 16 >= FEW_PROGRAMS:
        t = MosaicTiling(32, 1, 3)
    else:
        t = MosaicTiling(16 if N // 16 >= sm_count else 8, 2 if K >= 8192 else 1, 4)
    return t if t.fits(N, K) else None


def _step_products(t: MosaicTiling, codes, scales, x_step, acc):
    """acc [bn groups, 32] f32 (register r of a thread: row t.thread_rows()[r], its lane's group)
    plus one K step's products: codes [bn, block_k/8] i32, scales [bn, block_k/16] i8 (e4m3),
    x_step [groups, 256] i32, all SMEM."""
    lane, warp = _lane_and_warp()
    f32 = ir.F32Type.get()
    half = arith.remui(warp, _c(t.groups))
    group = arith.addi(lane, arith.muli(half, _c(32)))
    x_words, unscale = _group_pairs(x_step, half, lane)
    registers = np.empty_like(acc.registers)
    for r, row in enumerate(t.thread_rows(warp)):
        row = _index(row)
        words = vector.load(ir.VectorType.get((WORDS_A_GROUP,), _i32()), codes, [row, _index(arith.muli(group, _c(2)))])
        scale_byte = arith.extui(_i32(), memref.load(scales, [row, _index(group)]))
        [scale] = _asm([f32], _E4M3_TO_F32_PTX, "=f,r", [scale_byte])
        scale = arith.mulf(scale, unscale)  # the group's 2^-shift
        old = _element(acc.registers[r], 0)
        new, _ = _asm([f32, f32], _NVFP4_HALF_PTX, _PRODUCTS_CONSTRAINTS,
                      [_element(words, 0), _element(words, 1), *x_words, scale, scale, old, old])
        registers[r] = vector.from_elements(ir.VectorType.get((1,), f32), [new])
    return mgpu.FragmentedArray(_registers=registers, _layout=acc.layout, _is_signed=None)


def _store_rows(t: MosaicTiling, acc, out, global_scale, partials):
    """out [bn] (GMEM, x's dtype) = each row's sum of its lanes and groups times the global scale x
    2^14 (the decode's 2^-14 undone). A warp's lanes add by shuffles; with more than one group
    a step the warps sharing a row meet in partials [bn, groups] f32 (SMEM). Threads storing the same
    value to one address make one transaction."""
    f32 = ir.F32Type.get()
    lane, warp = _lane_and_warp()
    factor = arith.mulf(memref.load(global_scale, [_index(_c(0))]), arith.constant(f32, E2M1_SHRINK))
    out_type = ir.MemRefType(out.type).element_type
    for r, row in enumerate(t.thread_rows(warp)):
        total = _element(acc.registers[r], 0)
        for distance in (16, 8, 4, 2, 1):
            total = arith.addf(total, mgpu_utils.shfl_bfly(total, distance))
        if t.groups == 1:
            memref.store(arith.truncf(out_type, arith.mulf(total, factor)), out, [_index(row)])
        else:
            memref.store(total, partials, [_index(row), _index(arith.remui(warp, _c(t.groups)))])
    if t.groups > 1:
        mgpu_utils.warpgroup_barrier()
        row = arith.remui(mgpu_utils.thread_idx(), _c(t.bn))
        total = memref.load(partials, [_index(row), _index(_c(0))])
        for gi in range(1, t.groups):
            total = arith.addf(total, memref.load(partials, [_index(row), _index(_c(gi))]))
        memref.store(arith.truncf(out_type, arith.mulf(total, factor)), out, [_index(row)])


# ----------------------------------------------------------------------------- the kernel


def nvfp4_gemv_mosaic(x: jax.Array, data: jax.Array, scale: jax.Array, global_scale: jax.Array,
                      tiling: MosaicTiling = MosaicTiling()) -> jax.Array:
    """x [1, K] bf16, data [N, K/2] uint8 (E2M1_BITS layout), scale [N, K/16] float8_e4m3fn,
    global_scale [] float32 -> x W^T [1, N] bf16. `tiling.fits(N, K)` must hold; a GPU with TMA (Hopper)."""
    N, K = data.shape[0], 2 * data.shape[1]
    t = tiling
    if x.shape != (1, K) or x.dtype != jnp.bfloat16:
        raise ValueError(f"nvfp4_gemv_mosaic takes one bf16 row [1, {K}] for a [{N}, {K}] weight, "
                         f"got {x.dtype} {x.shape}")
    if not t.fits(N, K):
        raise ValueError(f"{t} does not fit an NVFP4 weight [{N}, {K}]: N must divide by bn, K by {t.block_k} "
                         f"and stay within {256 * 512}")
    words = jax.lax.bitcast_convert_type(data.reshape(N, K // 8, 4), jnp.int32)
    scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8)
    acc_shape = (t.bn * t.groups, 32)
    acc_layout = plgpu.Layout.WG_STRIDED(acc_shape, vec_size=1)
    ref = plgpu.RefType()

    products = plgpu.inline_mgpu(arg_types=(ref, ref, ref, acc_layout),
                                 return_type=plgpu.ShapeDtypeStruct(acc_shape, jnp.float32, layout=acc_layout))(
        lambda ctx, *args: _step_products(t, *args))
    store = plgpu.inline_mgpu(arg_types=(acc_layout, ref, ref, ref))(lambda ctx, *args: _store_rows(t, *args))

    def nvfp4_gemv(x_gmem, w_gmem, s_gmem, g_gmem, o_gmem, x_smem, x_arrived, partials):  # names the GPU kernel
        rows = pl.ds(jax.lax.axis_index("n") * t.bn, t.bn)
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, x_arrived)  # the whole row, once, beside the weights' ring

        def step(indices, codes, scales, acc):
            [k] = indices
            pl.when(k == 0)(lambda: plgpu.barrier_wait(x_arrived))
            return products(codes, scales, x_smem.at[pl.ds(k * t.groups, t.groups)], acc)

        acc = plgpu.emit_pipeline(
            step, grid=(K // t.block_k,), max_concurrent_steps=t.stages,
            in_specs=[plgpu.BlockSpec((t.bn, t.block_k // 8), lambda k: (0, k)),
                      plgpu.BlockSpec((t.bn, t.block_k // GROUP), lambda k: (0, k))],
            init_carry=plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), acc_layout),
        )(w_gmem.at[rows], s_gmem.at[rows])
        store(acc, o_gmem.at[rows], g_gmem, partials)

    x_rows = jax.lax.bitcast_convert_type(x.reshape(K // 512, 256, 2), jnp.int32)  # TMA boxes stop at 256 a side
    out = plgpu.kernel(
        nvfp4_gemv, out_type=jax.ShapeDtypeStruct((N,), x.dtype), grid=(N // t.bn,), grid_names=("n",),
        scratch_types=dict(x_smem=plgpu.SMEM(x_rows.shape, jnp.int32), x_arrived=plgpu.Barrier(num_arrivals=1),
                           partials=plgpu.SMEM((t.bn, t.groups), jnp.float32)),
    )(x_rows, words, scale_bytes, jnp.reshape(global_scale, (1,)).astype(jnp.float32))
    return out[None, :]
