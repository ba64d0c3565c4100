"""The packed-half GEMV: one activation row (decode at batch 1) times a weight-only quantized weight
(int8, fp8 per channel or in 128 blocks, NVFP4), contracted by packed f16 pairs in inline PTX instead
of float32 multiply-and-sum. `half_row` scales and pairs the row (its own launch), `half_gemv` runs
the GEMV on it; `half_word_sums` is what the PTX adds for each weight word, in jnp (the CPU's form).
The Triton matmul (quant_matmul_triton.py) sends one row here when its tiling asks for packed halves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.quant_formats import (BLOCK, E2M1_SHRINK, FP8, VALUES_PER_WORD, X_PAIR_VALUES, X_TOP_EXPONENT,
                                          QuantizedWeight, decode_e2m1, nvfp4_decode_ptx, nvfp4_sum_ptx,
                                          scale_operands, unpack_e2m1)
from pallas_kernels.quant_tiling import Tiling, next_pow2

# One activation row (decode at batch 1) of int8, fp8 (per channel or 128 blocks) or NVFP4 weights.
# Multiply-and-sum in float32 costs 5 or more instructions a weight, and the H200 runs out of
# instruction issue before HBM runs out of bytes. Here one inline-PTX call takes two 32-bit weight
# words, decodes them straight into f16 pairs, multiplies them with f16 activation pairs two at a time
# (fma.f16x2) and adds the sum, in float32 and times the words' scale, to that word pair's accumulator:
# about 3 instructions a weight. f16 keeps the products and their short sums (4 terms a lane; NVFP4 16)
# to 2^-11 when each program's K range of the activation row is first scaled by a power of two, its
# largest |x| into [2^(T-1), 2^T): high enough that small values keep their bits, low enough that no sum
# leaves f16's range (T: `X_TOP_EXPONENT`; the bound is terms x max |weight| x 2^T). A row kernel scales and pairs
# the row first (one launch where XLA takes three fusions); each GEMV program scales its sums back
# once, after its K loop. Converting the bf16 row inside the GEMV loop instead costs more than the
# row kernel's launch (H200, BENCHMARKS.md).


def _e4m3_to_f16_pairs_ptx(n: int) -> str:
    """PTX that widens the e4m3 byte pairs l0..l{n-1} into f16 pairs h0..h{n-1}."""
    return " ".join(f"cvt.rn.f16x2.e4m3x2 h{i}, l{i};" for i in range(n))


# Operands of every call: $0 $1 the two words' accumulators out; $2 $3 the weight words; then the
# activation pair words, two per array (one for each weight word), the two words' scales and the two
# accumulators in. int8 and fp8 words hold 4 values; activation arrays A, B hold pairs (0, 1) and
# (2, 3) of each word. The sum of all products, times the first word's scale, goes to the first
# accumulator (both words share their scale).
_PAIR_PRODUCTS = """mul.f16x2 p, h0, $4; fma.rn.f16x2 p, h1, $6, p;
fma.rn.f16x2 p, h2, $5, p; fma.rn.f16x2 p, h3, $7, p;
mov.b32 {a, b}, p; cvt.f32.f16 fa, a; cvt.f32.f16 fb, b; add.f32 fa, fa, fb;
fma.rn.f32 $0, fa, $8, $10; mov.b32 $1, $11;
}"""
_HALF_REGS = "{\n.reg .b32 t, u, m, p, q, h<8>, e<4>;\n.reg .b16 l<8>;\n.reg .f16 a, b;\n.reg .f32 fa, fb;\n"
# int8: the byte, sign bit flipped, becomes the low byte of f16 1024 + (x + 128); subtracting 1152 leaves x.
_INT8_HALF_PTX = _HALF_REGS + """mov.b32 m, 0x64806480;
xor.b32 t, $2, 0x80808080; prmt.b32 h0, t, 0x64646464, 0x4140; prmt.b32 h1, t, 0x64646464, 0x4342;
xor.b32 t, $3, 0x80808080; prmt.b32 h2, t, 0x64646464, 0x4140; prmt.b32 h3, t, 0x64646464, 0x4342;
sub.f16x2 h0, h0, m; sub.f16x2 h1, h1, m; sub.f16x2 h2, h2, m; sub.f16x2 h3, h3, m;
""" + _PAIR_PRODUCTS
_FP8_HALF_PTX = (_HALF_REGS + "mov.b32 {l0, l1}, $2; mov.b32 {l2, l3}, $3;\n" + _e4m3_to_f16_pairs_ptx(4) + "\n"
                 + _PAIR_PRODUCTS)

_NVFP4_HALF_PTX = (_HALF_REGS + nvfp4_decode_ptx(("$2", "$3"), [f"h{i}" for i in range(8)]) + "\n"
                   + nvfp4_sum_ptx([f"h{i}" for i in range(8)], [f"${i}" for i in range(4, 12)])
                   + " cvt.f32.f16 fa, a;\nfma.rn.f32 $0, fa, $12, $14; mov.b32 $1, $15;\n}")
_HALF_PTX = {"int8": _INT8_HALF_PTX, "fp8": _FP8_HALF_PTX, "fp8_block": _FP8_HALF_PTX, "nvfp4": _NVFP4_HALF_PTX}


def half_word_sums(fmt: str, words: jax.Array, x_pairs: list[jax.Array], scale: jax.Array) -> jax.Array:
    """What the PTX adds for each weight word, in float32 arithmetic (the CPU's form): words int32
    [..., W], x_pairs the f16-pair words (bitcast to int32) [..., W], scale [..., W] -> [..., W]."""
    lanes = {value: jax.lax.bitcast_convert_type(a, jnp.float16)[..., lane].astype(jnp.float32)
             for a, pair in zip(x_pairs, X_PAIR_VALUES[fmt]) for lane, value in enumerate(pair)}
    x = jnp.stack([lanes[v] for v in sorted(lanes)], axis=-1)  # [..., W, values a word] in the word's order
    if fmt != "nvfp4":
        values = jax.lax.bitcast_convert_type(words, jnp.int8 if fmt == "int8" else FP8).astype(jnp.float32)
    else:  # byte j holds values 2j, 2j + 1
        codes = jnp.stack(unpack_e2m1(jax.lax.bitcast_convert_type(words, jnp.uint8)), axis=-1)
        values = decode_e2m1(codes.reshape(*words.shape, 8)) / E2M1_SHRINK
    return jnp.sum(values * x, axis=-1) * scale


def _half_products(fmt: str, words: jax.Array, x_pairs: list[jax.Array], scale: jax.Array, acc: jax.Array,
                   ptx: bool) -> jax.Array:
    """acc [bn, bw] plus each weight word pair's products times its scale [bn, bw] (the PTX on the GPU)."""
    if not ptx:
        return acc + half_word_sums(fmt, words, x_pairs, scale)
    args = [words, *x_pairs, scale, acc]
    constraints = ",".join(["=f,=f"] + ["r,r"] * (1 + len(x_pairs)) + ["f,f"] * 2)
    [out] = plt.elementwise_inline_asm(_HALF_PTX[fmt], args=args, constraints=constraints, pack=2,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(acc.shape, jnp.float32)])
    return out


def _f32_power_of_two(e: jax.Array) -> jax.Array:
    """2^e as float32 from its bits, e int32 in [-126, 127] (no exp2 rounding, no overflow)."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _half_row_kernel(x_ref, bits_ref, pairs_ref, post_ref, *, fmt: str, chunk: int, ranges: int):
    """Program c: words [c chunk, (c + 1) chunk) of the row x [K] as f16 pair words (int32) in
    pairs_ref [P, W], scaled by 2^shift so that the largest |x| of the K range holding them (one of
    `ranges`, one per split GEMV program) lies in [2^(T-1), 2^T), and 2^-shift in post_ref[range].
    Every program finds its range's largest |x| itself (one masked load of the range, read as bf16
    bit pairs bits_ref [K/2] int32, their integer maximum): no second launch, no serial loop. Its own
    chunk is loaded first, so that load is in flight while the maximum is reduced (H200: 0.05-0.2
    us of 1.2-1.8)."""
    K, stride = x_ref.shape[0], VALUES_PER_WORD[fmt]
    c = pl.program_id(0)
    values = [x_ref[pl.ds(c * chunk * stride + offset, chunk, stride=stride)].astype(jnp.float32)
              for offset in range(stride)]  # value `offset` of each of this program's words
    length = K // ranges
    r = c * chunk * stride // length
    size = next_pow2(length // 2)
    span = plt.load(bits_ref.at[pl.ds(r * (length // 2), size)], mask=jnp.arange(size) < length // 2, other=0)
    top = jnp.max(jnp.maximum(span & 0x7FFF, (span >> 16) & 0x7FFF))  # the largest |x|'s bf16 bits
    biased = top >> 7  # its exponent field: top = m 2^(biased - 126), m in [0.5, 1)
    shift = jnp.clip(X_TOP_EXPONENT[fmt] - (biased - 126), -126, 126)
    scale = _f32_power_of_two(shift)

    def f16_bits(offset):  # value `offset` of each of this program's words, scaled, as f16 bits
        return jax.lax.bitcast_convert_type((values[offset] * scale).astype(jnp.float16),
                                            jnp.int16).astype(jnp.int32) & 0xFFFF

    for j, (lo, hi) in enumerate(X_PAIR_VALUES[fmt]):
        pairs_ref[j, pl.ds(c * chunk, chunk)] = f16_bits(lo) | (f16_bits(hi) << 16)

    @pl.when(c * chunk * stride % length == 0)  # the range's first program
    def _():
        post_ref[r] = _f32_power_of_two(-shift)


def half_row(x: jax.Array, fmt: str, ranges: int = 1, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """One row x [1, K] -> (activation pair words [P, W] int32, each of `ranges` equal K ranges scaled
    by its own power of two, in f16, paired as the PTX meets them; 2^-shift [ranges] float32, which
    scales each range's sums back)."""
    K = x.shape[1]
    W = K // VALUES_PER_WORD[fmt]
    chunk = min(128, (W // ranges) & -(W // ranges))  # a power of two (Triton's blocks) dividing a range
    def whole(shape):
        return pl.BlockSpec(shape, lambda c: (0,) * len(shape))
    shapes = (len(X_PAIR_VALUES[fmt]), W), (ranges,)
    bits = jax.lax.bitcast_convert_type(x.reshape(K // 2, 2), jnp.int32)  # the same bytes: no XLA kernel
    return pl.pallas_call(
        functools.partial(_half_row_kernel, fmt=fmt, chunk=chunk, ranges=ranges), grid=(W // chunk,),
        out_shape=tuple(jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, (jnp.int32, jnp.float32))),
        in_specs=[whole((K,)), whole((K // 2,))], out_specs=tuple(whole(s) for s in shapes),
        compiler_params=plt.CompilerParams(num_warps=_row_warps(K // ranges)), interpret=interpret,
        name=f"quant_gemv_row_{fmt}",
    )(x.reshape(-1), bits)


def _row_warps(length: int) -> int:
    """Warps of a row-kernel program that reduces a K range of `length` values: 16 past 8192 values,
    where the wider reduction is faster on the H200 (a 27B down projection's row of 17408), else 8
    (BENCHMARKS.md)."""
    return 16 if length > 8192 else 8


# NVFP4's group scales reach their two words by one contiguous load and a broadcast, which Triton
# lays out through shared memory with a barrier each K step. Above SHARED_SCALES_MAX_WARPS that
# barrier costs more than per-word loads' address arithmetic (H200, BENCHMARKS.md), so each word
# loads its own scale.
SHARED_SCALES_MAX_WARPS = 8


def _word_scales(s_ref, n0, step, *, fmt: str, bn: int, bw: int, gathered: bool) -> jax.Array:
    """What each weight word's products [bn, bw] are multiplied by at K step `step`: its group's scale
    (NVFP4: one for each of a group's two words, broadcast from one load or `gathered` word by word),
    its 128 x 128 block's (fp8 blocks), or 1 (per-channel scales multiply the sums once, after the K loop)."""
    if fmt == "nvfp4":
        if gathered:
            cols = step * (bw // 2) + jax.lax.broadcasted_iota(jnp.int32, (1, bw), 1) // 2
            return s_ref[n0 + jax.lax.broadcasted_iota(jnp.int32, (bn, 1), 0), cols].astype(jnp.float32)
        groups = s_ref[pl.ds(n0, bn), pl.ds(step * (bw // 2), bw // 2)].astype(jnp.float32)
        return jnp.broadcast_to(groups[:, :, None], (bn, bw // 2, 2)).reshape(bn, bw)
    if fmt != "fp8_block":
        return jnp.ones((bn, bw), jnp.float32)
    words = BLOCK // VALUES_PER_WORD[fmt]  # a scale block's columns, in words
    if bw <= words:  # the step sits inside one scale block
        return jnp.broadcast_to(s_ref[n0 // BLOCK, step * bw // words], (bn, bw))
    blocks = s_ref[n0 // BLOCK, pl.ds(step * (bw // words), bw // words)]
    return jnp.broadcast_to(blocks[None, :, None], (bn, bw // words, words)).reshape(bn, bw)


def _half_gemv_block(x_ref, post_ref, w_ref, s_ref, g_ref, o_ref, n0, j, *, fmt: str, bn: int, bw: int, k_steps: int,
                     ptx: bool, gathered: bool):
    """Output columns [n0, n0 + bn) of the one row over the j-th split K range. One float32
    accumulator a weight word [bn, bw] (the PTX fills every other one), summed after the K loop.
    Each step's tiles are loaded a step ahead and carried through the loop, so their latency hides
    behind the products."""
    first_step = j * k_steps

    def load(i):
        cols = pl.ds(i * bw, bw)
        x_pairs = [jnp.broadcast_to(x_ref[pl.ds(a, 1), cols], (bn, bw)) for a in range(x_ref.shape[0])]
        return w_ref[pl.ds(n0, bn), cols], x_pairs, _word_scales(s_ref, n0, i, fmt=fmt, bn=bn, bw=bw, gathered=gathered)

    def body(i, carry):
        acc, (words, x_pairs, scale) = carry
        ahead = load(first_step + jnp.minimum(i + 1, k_steps - 1))  # the last step reloads its own tiles
        return _half_products(fmt, words, x_pairs, scale, acc, ptx), ahead

    acc, _ = jax.lax.fori_loop(0, k_steps, body, (jnp.zeros((bn, bw), jnp.float32), load(first_step)))
    out = jnp.sum(acc, axis=1) * post_ref[j]
    if fmt == "nvfp4":
        out = out * (g_ref[0] * E2M1_SHRINK)  # the global scale, and the decode's 2^-14 undone
    elif fmt != "fp8_block":
        out = out * s_ref[pl.ds(n0, bn)]
    o_ref[pl.ds(j, 1), pl.ds(n0, bn)] = out[None, :].astype(o_ref.dtype)


def _half_gemv_kernel(*refs, bn: int, big: int, small_bn: int, **block):
    """Program (i, j): the j-th split K range of a block of output columns, bn of them for the first
    `big` programs, small_bn for the rest (the rows left after whole rounds of big ones)."""
    i, j = pl.program_id(0), pl.program_id(1)  # read here: interpret mode has no program_id inside a branch
    if not small_bn:
        return _half_gemv_block(*refs, i * bn, j, bn=bn, **block)
    pl.when(i < big)(lambda: _half_gemv_block(*refs, i * bn, j, bn=bn, **block))
    pl.when(i >= big)(lambda: _half_gemv_block(*refs, big * bn + (i - big) * small_bn, j, bn=small_bn, **block))


def half_gemv(x: jax.Array, w: QuantizedWeight, t: Tiling, interpret: bool) -> jax.Array:
    """The packed-half kernels on one row x [1, K] -> [1, N] in x's dtype."""
    N, K = w.shape
    per_word = VALUES_PER_WORD[w.format]
    x_pairs, post = half_row(x, w.format, t.split_k, interpret)
    words = jax.lax.bitcast_convert_type(w.data.reshape(N, K // per_word, 4), jnp.int32)
    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
    args = (x_pairs, post, words, *scale_operands(w))
    bw = t.block_k // per_word  # weight words a step
    big, small, small_bn = t.row_blocks(N, bw)
    kernel = functools.partial(_half_gemv_kernel, fmt=w.format, bn=t.block_n, big=big, small_bn=small_bn, bw=bw,
                               k_steps=K // (t.block_k * t.split_k), ptx=not interpret,
                               gathered=t.num_warps > SHARED_SCALES_MAX_WARPS)
    out = pl.pallas_call(  # one K range writes x's dtype; split K writes float32 partial sums
        kernel, out_shape=jax.ShapeDtypeStruct((t.split_k, N), x.dtype if t.split_k == 1 else jnp.float32),
        grid=(big + small, t.split_k), in_specs=[whole(a) for a in args],
        out_specs=pl.BlockSpec((t.split_k, N), lambda i, j: (0, 0)),
        compiler_params=plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret, name=f"quant_gemv_{w.format}",
    )(*args)
    return out if t.split_k == 1 else jnp.sum(out, axis=0, keepdims=True).astype(x.dtype)

