"""Quantized matmuls: the formats' dequantization, and the Pallas kernel in interpret mode against
dequantize-then-dot (bf16 output, ~2e-3 relative)."""

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import relative_error

from pallas_kernels.quant_formats import (FORMATS, QuantizedWeight, decode_e2m1, dequantize, nvfp4_from_modelopt,
                                          quant_matmul_reference, quantize)
from pallas_kernels.quant_matmul import MEASURED_ON, TUNED, pick_tiling, quant_matmul
from pallas_kernels.quant_matmul_triton import quant_matmul_pallas
from pallas_kernels.quant_tiling import Tiling

TUNED_H200 = TUNED[MEASURED_ON]

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
N, K = 128, 256


def test_all_sixteen_e2m1_codes():
    want = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert decode_e2m1(jnp.arange(16, dtype=jnp.uint8)).tolist() == want


def test_nvfp4_modelopt_bytes_keep_the_even_column_in_the_low_nibble():
    # Row 0: columns (0, 1) hold codes (1, 7) = (0.5, 6.0), column 3 code 11 = -1.5; every scale 1.0; global scale 2.
    packed = np.zeros((1, 16), np.uint8)
    packed[0, :2] = 1 | (7 << 4), 11 << 4
    w = QuantizedWeight(jnp.asarray(nvfp4_from_modelopt(packed)), jnp.ones((1, 2), jnp.float8_e4m3fn),
                        jnp.asarray(2.0, jnp.float32), "nvfp4")
    assert dequantize(w)[0, :5].tolist() == [1.0, 12.0, 0.0, -3.0, 0.0]


def test_nvfp4_bytes_round_trip_every_code_pair():
    """Every ModelOpt byte (256 code pairs) survives the trip into the kernels' layout and back, and
    the two layouts are different byte orders of the same codes (no two bytes collide)."""
    from pallas_kernels.quant_formats import nvfp4_to_modelopt, unpack_e2m1

    every = np.arange(256, dtype=np.uint8)
    ours = nvfp4_from_modelopt(every)
    assert len(set(ours.tolist())) == 256
    np.testing.assert_array_equal(nvfp4_to_modelopt(ours), every)
    even, odd = unpack_e2m1(jnp.asarray(ours))
    np.testing.assert_array_equal(np.asarray(even), every & 15)
    np.testing.assert_array_equal(np.asarray(odd), every >> 4)


def test_nvfp4_even_column_reads_as_e5m2_and_the_odd_one_mirrored():
    """The layout's point: byte & 0x8E is the even column's value times 2^-14 as e5m2, and the
    bit-reversed byte & 0x8E the odd column's, for all 16 codes in each."""
    from pallas_kernels.quant_formats import E2M1_SHRINK, E5M2_E2M1_MASK, pack_e2m1

    codes = np.arange(16, dtype=np.uint8)
    want = np.asarray(decode_e2m1(jnp.asarray(codes)))
    def as_e5m2(b):
        return np.asarray(b, np.uint8).view(ml_dtypes.float8_e5m2).astype(np.float32) * E2M1_SHRINK
    def mirrored(b):
        return np.array([int(f"{v:08b}"[::-1], 2) for v in b], np.uint8)
    np.testing.assert_array_equal(as_e5m2(np.asarray(pack_e2m1(codes, 15 - codes)) & E5M2_E2M1_MASK), want)
    np.testing.assert_array_equal(as_e5m2(mirrored(np.asarray(pack_e2m1(15 - codes, codes))) & E5M2_E2M1_MASK), want)


def test_fp8_block_scales_apply_per_128_block():
    data = jnp.ones((256, 256), jnp.float8_e4m3fn)
    scale = jnp.asarray([[1.0, 2.0], [3.0, 4.0]], jnp.float32)
    d = dequantize(QuantizedWeight(data, scale, None, "fp8_block"))
    assert [float(d[0, 0]), float(d[0, 128]), float(d[128, 0]), float(d[255, 255])] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("fmt, tol", [("int8", 0.02), ("fp8", 0.06), ("fp8_block", 0.06), ("nvfp4", 0.2)])
def test_quantization_error_is_what_the_format_allows(fmt, tol):
    w = np.random.default_rng(0).normal(size=(N, K)).astype(np.float32)
    assert relative_error(dequantize(quantize(w, fmt)), w) < tol


CASES = [(1, False, False), (1, True, False), (3, True, False), (16, False, False)]  # (M, gemv, packed halves)


@pytest.mark.parametrize("fmt, M, gemv, packed", [
    (fmt, *case) for fmt in FORMATS for case in CASES + [(1, True, True)]])
def test_kernel_matches_dequantize_then_dot(fmt, M, gemv, packed):
    """gemv: one row by multiply-and-sum, or by packed f16 pairs (interpret mode runs their float32
    form); more rows (or gemv off) by the dot on rows padded to 16."""
    rng = np.random.default_rng(M)
    w = quantize(rng.normal(size=(N, K)).astype(np.float32), fmt)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    got = quant_matmul_pallas(x, w, tiling=Tiling(gemv=gemv, packed_halves=packed), interpret=True)
    want = quant_matmul_reference(x.astype(jnp.float32), w)
    assert got.shape == (M, N) and got.dtype == jnp.bfloat16
    assert relative_error(got, want) < 2e-3 * 4  # bf16 output rounding plus bf16 dequantized tiles


@pytest.mark.parametrize("fmt, tiling", [(fmt, Tiling(block_n=32, block_k=64, split_k=2)) for fmt in FORMATS] + [
    (fmt, Tiling(16, 128, split_k=2, gemv=True, packed_halves=True)) for fmt in FORMATS])
def test_split_k_partial_sums_add_up(fmt, tiling):
    """K cut over 2 programs per column block (the small-M tiling; a one-row GEMV of few programs)
    gives the same product, each range its two steps."""
    rng = np.random.default_rng(5)
    w = quantize(rng.normal(size=(N, K)).astype(np.float32), fmt)
    x = jnp.asarray(rng.normal(size=(1, K)), jnp.bfloat16)
    got = quant_matmul_pallas(x, w, tiling=tiling, interpret=True)
    assert relative_error(got, quant_matmul_reference(x.astype(jnp.float32), w)) < 2e-3 * 4


def test_nvfp4_scales_loaded_word_by_word_give_the_broadcast_ones_product():
    """Above SHARED_SCALES_MAX_WARPS warps each weight word loads its group's scale itself; the
    product is the same, bit for bit, and matches the reference."""
    from pallas_kernels.quant_half_gemv import SHARED_SCALES_MAX_WARPS

    rng = np.random.default_rng(9)
    w = quantize(rng.normal(size=(32, 1024)).astype(np.float32) * rng.uniform(0.1, 10, size=(32, 64)).repeat(16, 1),
                 "nvfp4")  # scales that differ group to group
    x = jnp.asarray(rng.normal(size=(1, 1024)), jnp.bfloat16)
    broadcast, gathered = (quant_matmul_pallas(x, w, tiling=Tiling(16, 512, 1, warps, gemv=True, packed_halves=True),
                                               interpret=True) for warps in (SHARED_SCALES_MAX_WARPS, 16))
    np.testing.assert_array_equal(np.asarray(gathered, np.float32), np.asarray(broadcast, np.float32))
    assert relative_error(gathered, quant_matmul_reference(x.astype(jnp.float32), w)) < 2e-3 * 4


def test_dispatch_tiling_falls_back_to_what_divides_the_shape():
    x = jnp.zeros((1, K), jnp.bfloat16)
    w = quantize(np.ones((N, K), np.float32), "fp8_block")
    assert pick_tiling(x, w) == TUNED_H200.gemv_fallback  # K = 256: no 512-wide steps, 128-wide ones
    assert pick_tiling(jnp.zeros((1, 192), jnp.bfloat16), quantize(np.ones((N, 192), np.float32), "int8")) is None
    assert pick_tiling(jnp.zeros((65, K), jnp.bfloat16), w) is None
    narrow = quantize(np.ones((48, K), np.float32), "int8")  # 48 columns: 16-wide GEMV blocks only
    assert pick_tiling(x, narrow) == TUNED_H200.gemv_fallback
    nvfp4 = quantize(np.ones((N, 384), np.float32), "nvfp4")  # 512 does not divide K: 128-wide packed halves
    assert pick_tiling(jnp.zeros((1, 384), jnp.bfloat16), nvfp4) == Tiling(16, 128, gemv=True, packed_halves=True)
    assert pick_tiling(jnp.zeros((2, K), jnp.bfloat16), narrow) is None


def test_dispatch_one_row_takes_a_gemv_tiling_more_rows_a_dot():
    w = quantize(np.ones((N, 2560), np.float32), "int8")
    assert pick_tiling(jnp.zeros((1, 2560), jnp.bfloat16), w) == TUNED_H200.multiply_and_sum  # 1.3 MB: one launch
    rows = 16 * TUNED_H200.few_programs  # enough programs to keep 4 warps each
    big = QuantizedWeight(jax.ShapeDtypeStruct((rows, TUNED_H200.half_min_bytes // rows), jnp.int8),
                          jax.ShapeDtypeStruct((rows,), jnp.float32), None, "int8")
    row = jnp.zeros((1, TUNED_H200.half_min_bytes // rows), jnp.bfloat16)
    assert pick_tiling(row, big) == TUNED_H200.one_row["int8"]
    assert TUNED_H200.one_row["int8"].packed_halves
    assert pick_tiling(jnp.zeros((1, 2560), jnp.bfloat16), w).gemv
    assert pick_tiling(jnp.zeros((2, 2560), jnp.bfloat16), w) == TUNED_H200.many_rows["int8"]
    w = quantize(np.ones((N, 384), np.float32), "int8")  # K = 384: 512 does not divide it, the GEMV fallback does
    assert pick_tiling(jnp.zeros((1, 384), jnp.bfloat16), w) == TUNED_H200.gemv_fallback


def test_dispatch_gives_few_packed_half_programs_more_warps_and_a_big_weight_deeper_steps():
    """A short, wide weight makes few 16-row programs: they get 8 warps; where the programs stay few
    and the weight is big, 1024-wide steps and 16 warps unsplit, else K split 2 ways (512-wide steps
    where they divide it, else the format's own), else neither; a tall weight keeps 4 warps."""
    def one_row(n, k=5120, fmt="nvfp4"):
        return pick_tiling(jnp.zeros((1, k), jnp.bfloat16), jax.eval_shape(lambda: quantize(jnp.ones((n, k)), fmt)))
    nvfp4 = TUNED_H200.one_row["nvfp4"]
    assert one_row(16 * (TUNED_H200.few_programs - 1)) == dataclasses.replace(nvfp4, num_warps=8)
    assert one_row(16 * TUNED_H200.few_programs) == nvfp4 and nvfp4.num_warps == 4
    for fmt in FORMATS:  # 27B down: unsplit, 1024-wide steps, 16 warps (whole rounds make it even); fp8 blocks 32 rows
        rows = 32 if fmt == "fp8_block" else 16
        assert one_row(5120, 17408, fmt) == dataclasses.replace(TUNED_H200.one_row[fmt], block_n=rows, block_k=1024,
                                                                num_warps=16)
    int8 = dataclasses.replace(TUNED_H200.one_row["int8"], num_warps=8)
    # 1024 and 2 x 512 do not divide K, 2 x 256 does
    assert one_row(5120, 17408 + 512, "int8") == dataclasses.replace(int8, split_k=2)
    assert one_row(5120, 17408 + 256, "int8") == int8  # neither does: unsplit
    assert one_row(1024, 3584).split_k == 1  # 0.8B: 1.8 MB, the partial sums' addition would cost more


def test_rounds_give_the_rows_left_after_whole_rounds_to_smaller_programs():
    """27B up projection on 132 SMs: 1088 16-row programs would leave 32 SMs a ninth; instead 1056
    run in 8 whole rounds and 128 programs of 4 rows take the 512 rows left. Nothing left, a split
    K, or fewer blocks than SMs: one size."""
    t = dataclasses.replace(TUNED_H200.one_row["int8"], rounds=132)
    assert t.row_blocks(17408, 64) == (1056, 128, 4)
    assert t.row_blocks(16896, 64) == (1056, 0, 0)
    assert dataclasses.replace(t, split_k=2).row_blocks(17408, 64) == (1088, 0, 0)
    assert t.row_blocks(1024, 64) == (64, 0, 0)
    assert TUNED_H200.one_row["int8"].row_blocks(17408, 64) == (1088, 0, 0)
    deep = Tiling(16, 1024, 1, 16, gemv=True, packed_halves=True, rounds=132)  # 27B down, 256-word steps
    assert deep.row_blocks(5120, 256) == (264, 112, 8)
    assert deep.row_blocks(5120, 64) == (320, 0, 0)  # 8 rows of 64 words: under a word pair a thread
    assert dataclasses.replace(deep, block_n=32).row_blocks(5120, 256) == (132, 112, 8)  # fp8 blocks' deep tile
    up = jax.eval_shape(lambda: quantize(jnp.ones((17408, 5120)), "nvfp4"))
    assert pick_tiling(jnp.zeros((1, 5120), jnp.bfloat16), up, rounds=132).rounds == 132
    assert pick_tiling(jnp.zeros((2, 5120), jnp.bfloat16), up, rounds=132).rounds == 0  # the dot path


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_half_gemv_with_smaller_programs_for_the_rows_left_matches(fmt):
    """N = 144: nine 16-row blocks over 4 "SMs" leave one block, taken by smaller programs (4 rows,
    8 for NVFP4, whose 32-word steps need 8 rows to give each thread a word pair)."""
    from pallas_kernels.quant_formats import VALUES_PER_WORD

    rng = np.random.default_rng(8)
    w = quantize(rng.normal(size=(144, 512)).astype(np.float32), fmt)
    x = jnp.asarray(rng.normal(size=(1, 512)), jnp.bfloat16)
    tiling = Tiling(16, 256, gemv=True, packed_halves=True, rounds=4)
    assert tiling.row_blocks(144, 256 // VALUES_PER_WORD[fmt]) == ((8, 2, 8) if fmt == "nvfp4" else (8, 4, 4))
    got = quant_matmul_pallas(x, w, tiling=tiling, interpret=True)
    assert relative_error(got, quant_matmul_reference(x.astype(jnp.float32), w)) < 2e-3 * 4


@pytest.mark.parametrize("M, tiling", [(1, Tiling(16, 512, 1, gemv=True)), (1, Tiling(16, 64, 2, gemv=True)),
                                       (1, Tiling(16, 512, 1, gemv=True, packed_halves=True)),
                                       (1, Tiling(16, 64, 2, gemv=True, packed_halves=True)),
                                       (3, Tiling(16, 512, 2)), (3, Tiling(16, 64, 1))])
def test_fp8_block_tiles_scale_each_128_column_block_they_span(M, tiling):
    """Columns scaled 0.01x to 100x per 128-column block: a tile that applied one block's scale to
    another's columns would be off by orders of magnitude. N = 144 leaves a partial row block."""
    rng = np.random.default_rng(3)
    per_block = np.repeat(10.0 ** rng.uniform(-2, 2, size=8), 128)
    w = quantize((rng.normal(size=(144, 1024)) * per_block).astype(np.float32), "fp8_block")
    x = jnp.asarray(rng.normal(size=(M, 1024)), jnp.bfloat16)
    got = quant_matmul_pallas(x, w, tiling=tiling, interpret=True)
    assert relative_error(got, quant_matmul_reference(x.astype(jnp.float32), w)) < 2e-3 * 4


def test_fp8_block_tile_rows_stay_inside_one_scale_block():
    w = quantize(np.ones((256, 256), np.float32), "fp8_block")
    with pytest.raises(ValueError, match="fp8_block also block_n \\| 128"):
        quant_matmul_pallas(jnp.zeros((1, 256), jnp.bfloat16), w, tiling=Tiling(256, 128, 1, gemv=True), interpret=True)
    assert not Tiling(16, 192).fits(quantize(np.ones((256, 384), np.float32), "int8"))  # Triton: powers of two
    assert Tiling(128, 256).fits(w)  # rows: one scale block; columns: two whole ones


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("x_scale", [1e-6, 1.0, 3e4])
def test_one_row_packed_half_gemv_takes_activations_of_any_size(fmt, x_scale):
    """One row of any size keeps bf16 accuracy: the packed-half GEMV scales the row by a power of two
    before f16 (3e4 x N(0, 1) reaches past f16's 65504; 1e-6 would lose its bits in f16's
    subnormals)."""
    rng = np.random.default_rng(11)
    w = quantize(rng.normal(size=(N, 1024)).astype(np.float32), fmt)
    x = jnp.asarray(rng.normal(size=(1, 1024)) * x_scale, jnp.bfloat16)
    tiling = TUNED_H200.one_row[fmt]
    assert tiling.packed_halves and tiling.fits(w)
    got = quant_matmul_pallas(x, w, tiling=tiling, interpret=True)
    assert relative_error(got, quant_matmul_reference(x.astype(jnp.float32), w)) < 2e-3 * 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_half_row_lands_inside_f16_range_by_range_and_is_paired_as_the_ptx_meets_it(fmt):
    """The row kernel puts each K range's largest |x| in [2^(T-1), 2^T) for the format's T, pairs the
    values as X_PAIR_VALUES says, and each range's factor undoes its scaling exactly. The ranges
    differ by 10^9 in size, so one scale for the whole row would lose the small ones to f16."""
    from pallas_kernels.quant_formats import VALUES_PER_WORD, X_PAIR_VALUES, X_TOP_EXPONENT
    from pallas_kernels.quant_half_gemv import half_row

    range_max, size, per_word = np.array([7e4, 3e-5, 1.0, 0.0]), 256, VALUES_PER_WORD[fmt]
    x = np.concatenate([np.linspace(-m, m / 3, size) * np.random.default_rng(0).permutation(size) / size
                        for m in range_max])
    x = jnp.asarray(x[None], jnp.bfloat16)
    pairs, post = half_row(x, fmt, len(range_max), interpret=True)
    assert post.shape == (len(range_max),)
    x16 = np.asarray(pairs).view(np.float16).astype(np.float32).reshape(len(pairs), len(range_max), size // per_word, 2)
    words = np.asarray(x, np.float32).reshape(len(range_max), size // per_word, per_word)
    top = X_TOP_EXPONENT[fmt]
    for r, m in enumerate(range_max):
        if m:
            assert 2.0 ** (top - 1) <= np.abs(x16[:, r]).max() < 2.0**top
        for j, lanes in enumerate(X_PAIR_VALUES[fmt]):  # [array, range, word, lane]
            np.testing.assert_array_equal(x16[j, r] * float(post[r]), words[r][:, lanes])


def test_one_row_gemv_scales_each_split_range_by_its_own_power_of_two():
    """Split K ranges whose activations differ by 10^9 in size, the weight's columns zero where they
    are large: only the small range counts. Its own scale keeps its products in f16's normal range;
    one scale for the whole row would round them to f16's zero. K = 1536: ranges of 768, not a power
    of two, so each range's maximum is a masked load past its end."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(1, 1536)) * np.repeat([3e4, 3e-5], 768), jnp.bfloat16)
    for fmt in FORMATS:
        w = quantize(rng.normal(size=(N, 1536)).astype(np.float32) * np.repeat([0.0, 1.0], 768), fmt)
        got = quant_matmul_pallas(x, w, tiling=Tiling(16, 128, 2, gemv=True, packed_halves=True), interpret=True)
        assert relative_error(got, quant_matmul_reference(x.astype(jnp.float32), w)) < 2e-3 * 4, fmt


def test_kernel_refuses_a_tiling_that_does_not_divide_the_weight():
    w = quantize(np.ones((48, K), np.float32), "int8")
    with pytest.raises(ValueError, match="does not divide a \\[48, 256\\] int8 weight"):
        quant_matmul_pallas(jnp.zeros((1, K), jnp.bfloat16), w, tiling=Tiling(block_n=32), interpret=True)
    nvfp4 = quantize(np.ones((N, K), np.float32), "nvfp4")  # 16 rows of 8 words: under a word pair for 128 threads
    assert not Tiling(16, 64, gemv=True, packed_halves=True).fits(nvfp4)
    with pytest.raises(ValueError, match="a weight-word pair for each of its threads"):
        quant_matmul_pallas(jnp.zeros((1, K), jnp.bfloat16), nvfp4,
                            tiling=Tiling(16, 64, gemv=True, packed_halves=True),
                            interpret=True)
    assert Tiling(16, 128, gemv=True, packed_halves=True).fits(nvfp4)
    assert not Tiling(16, 128, num_warps=8, gemv=True, packed_halves=True).fits(nvfp4)


def test_dispatcher_on_cpu_is_the_reference():
    w = quantize(np.random.default_rng(1).normal(size=(N, K)).astype(np.float32), "int8")
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, K)), jnp.float32)
    np.testing.assert_array_equal(quant_matmul(x, w), quant_matmul_reference(x, w))


def test_unknown_format():
    with pytest.raises(ValueError, match="unknown quantization format 'int4'"):
        quantize(np.zeros((4, 32), np.float32), "int4")


def test_fp8_dtype_is_e4m3fn():
    assert quantize(np.ones((4, 32), np.float32), "fp8").data.dtype == ml_dtypes.float8_e4m3fn


def run_ptx(asm: str, inputs: dict[int, int]) -> dict[str, int]:
    """A tiny interpreter for the PTX the GPU decodes and packed-half products use, so their bit
    recipes and lane orders are checked on the CPU. Registers hold bit patterns: integer ops (xor,
    and, or, shl, shr, brev, prmt), mov (also packing and unpacking {lo, hi} halves), float32 sub / add /
    fma, f16x2 sub / add / mul / fma (each lane rounded once), f16 add, and the cvts to f16x2 and f32."""
    regs = {f"${n}": v for n, v in inputs.items()}
    def value(t):
        return regs[t] if t in regs else int(t[2:], 16) if t.startswith("0f") else int(t, 0)
    def f32(u):
        return np.array([u], np.uint32).view(np.float32)[0].astype(np.float64)
    def u32(f):
        return int(np.array([f], np.float32).view(np.uint32)[0])
    def lanes(u):
        return np.array([u], np.uint32).view(np.float16).astype(np.float64)
    def packed(v):
        return int(np.asarray(v, np.float16).view(np.uint32)[0])  # one rounding from float64
    def half(u):
        return np.array([u], np.uint16).view(np.float16)[0].astype(np.float64)

    def prmt(a, b, sel):
        pool = (b << 32 | a).to_bytes(8, "little")
        out = 0
        for i in range(4):
            s = sel >> 4 * i & 15
            byte = pool[s & 7]
            out |= ((0xFF if byte & 0x80 else 0) if s & 8 else byte) << 8 * i
        return out

    def cvt(kind, a):
        if kind.endswith("e4m3x2"):  # the low byte to the low lane
            return packed(np.array([a & 0xFF, a >> 8], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
        return u32(half(a))  # f32 from f16

    ops = {"xor": lambda a, b: a ^ b, "and": lambda a, b: a & b, "or": lambda a, b: a | b,
           "shl": lambda a, b: a << b & 0xFFFFFFFF, "shr": lambda a, b: a >> b, "prmt": prmt,
           "brev": lambda a: int(f"{a:032b}"[::-1], 2),
           "sub.f32": lambda a, b: u32(f32(a) - f32(b)), "add.f32": lambda a, b: u32(f32(a) + f32(b)),
           "fma.f32": lambda a, b, c: u32(f32(a) * f32(b) + f32(c)),
           "sub.f16x2": lambda a, b: packed(lanes(a) - lanes(b)), "add.f16x2": lambda a, b: packed(lanes(a) + lanes(b)),
           "mul.f16x2": lambda a, b: packed(lanes(a) * lanes(b)),
           "fma.f16x2": lambda a, b, c: packed(lanes(a) * lanes(b) + lanes(c)),
           "add.f16": lambda a, b: int(np.float16(half(a) + half(b)).view(np.uint16))}
    for stmt in asm.replace("{\n", "\n").replace("\n}", "\n").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        dst, *srcs = [a.strip() for a in re.split(r",(?![^{]*})", args)]
        parts = op.split(".")
        if parts[0] == "mov" and dst.startswith("{"):  # unpack a 32-bit word into its halves
            lo, hi = dst.strip("{}").split(",")
            regs[lo.strip()], regs[hi.strip()] = value(srcs[0]) & 0xFFFF, value(srcs[0]) >> 16
        elif parts[0] == "mov":
            regs[dst] = value(srcs[0])
        elif parts[0] == "cvt":
            regs[dst] = cvt(op, value(srcs[0]))
        else:
            key = parts[0] if parts[-1].startswith("b") else f"{parts[0]}.{parts[-1]}"
            regs[dst] = ops[key](*map(value, srcs))
    return regs


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_half_ptx_adds_what_the_cpu_form_adds(fmt):
    """Each call of the one-row PTX, on random weight words, activation pairs, scale and
    accumulators, adds to the first accumulator what `half_word_sums` gives for its two words (to
    f16 rounding: 2^-9 of max |weight| x sum |x|; one term paired with the wrong activation is off
    by about 1/30 of that) and leaves the second accumulator alone."""
    from pallas_kernels.quant_half_gemv import _HALF_PTX, half_word_sums

    rng = np.random.default_rng(5)
    n_x = 4 if fmt == "nvfp4" else 2
    max_weight = {"int8": 128, "fp8": 448, "fp8_block": 448, "nvfp4": 6 / 2**14}[fmt]
    for _ in range(100):
        words = rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32)
        if fmt.startswith("fp8"):
            words &= 0xFEFEFEFE  # an even mantissa: no NaN bytes (0x7F, 0xFF)
        x = rng.normal(size=(n_x, 2, 2)).astype(np.float16)  # [array, word, lane]
        x_words = x.view(np.uint32)[..., 0]  # [array, word]
        scale, acc = np.float32(rng.uniform(0.5, 2)), rng.normal(size=2).astype(np.float32)
        operands = [*words, *x_words.reshape(-1), scale.view(np.uint32), scale.view(np.uint32)]
        regs = run_ptx(_HALF_PTX[fmt], {2 + i: int(v) for i, v in enumerate([*operands, *acc.view(np.uint32)])})
        got = np.array([regs["$0"], regs["$1"]], np.uint32).view(np.float32)
        sums = half_word_sums(fmt, jnp.asarray(words.view(np.int32)), [jnp.asarray(w.view(np.int32)) for w in x_words],
                              jnp.full(2, scale))
        bound = 2**-9 * max_weight * float(np.abs(x.astype(np.float32)).sum()) * scale
        assert got[1] == acc[1]
        assert abs(got[0] - (acc[0] + float(jnp.sum(sums)))) <= bound


def test_int8_ptx_turns_every_byte_into_its_float():
    from pallas_kernels.quant_matmul_triton import _INT8_TO_F32_PTX

    rng = np.random.default_rng(0)
    for word in [0x80FF007F, 0x01020304, *rng.integers(0, 2**32, 64).tolist()]:  # 4 int8 values, element i in byte i
        regs = run_ptx(_INT8_TO_F32_PTX, {4: word})
        want = np.array([word], np.uint32).view(np.int8).astype(np.float32)
        got = np.array([regs[f"${i}"] for i in range(4)], np.uint32).view(np.float32)
        np.testing.assert_array_equal(got, want)


def test_e2m1_ptx_reads_every_code_pair_as_e5m2_times_2_to_the_minus_14():
    """The many-row kernels' decode: four bytes a word, the even columns then the odd ones."""
    from pallas_kernels.quant_formats import E2M1_SHRINK, unpack_e2m1
    from pallas_kernels.quant_matmul_triton import _E2M1_TO_E5M2_PTX

    data = nvfp4_from_modelopt(np.arange(256, dtype=np.uint8))
    for asm, codes in zip(_E2M1_TO_E5M2_PTX, unpack_e2m1(jnp.asarray(data))):
        out = np.array([run_ptx(asm, {1: int(w)})["$0"] for w in data.view(np.uint32)], np.uint32)
        got = out.view(ml_dtypes.float8_e5m2).astype(np.float32) * E2M1_SHRINK
        np.testing.assert_array_equal(got, np.asarray(decode_e2m1(codes)))