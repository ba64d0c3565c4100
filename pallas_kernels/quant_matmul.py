"""Weight-only quantized matmul y = x W^T for decode and verify batches (1 to 64 rows).

Formats, their bit layouts and decode PTX: `quant_formats`.

`quant_matmul` is the dispatcher: a Pallas kernel on a GPU (1-16 bf16 rows of NVFP4 on Hopper: the
Mosaic GPU kernels of nvfp4_gemv_mosaic.py and nvfp4_mma_mosaic.py; the rest this module's Triton
kernel), dequantize-then-dot elsewhere. The Triton kernel runs one program per block of BN output
channels (and per K range when K is split), loops over K in BK tiles, dequantizes each weight tile
in registers and accumulates in float32. A single activation row (decode at batch 1) is contracted
by packed f16 pairs in their own kernels (below); more rows by a bf16 tensor-core dot on rows
padded to 16 (Triton's smallest). On the GPU the int8 and e2m1 decodes are inline PTX bit tricks
(int8 without the int-to-float converter; e2m1 codes stored where f16 and e5m2 keep those bits, so
a mask decodes them).
Measured one-row figures are in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import PartitionSpec as P

from pallas_kernels import nvfp4_gemv_mosaic, nvfp4_mma_mosaic
from pallas_kernels.quant_formats import (BLOCK, E2M1_SHRINK, E5M2_E2M1_MASK, FP8, GROUP, VALUES_PER_WORD,
                                          X_PAIR_VALUES, X_TOP_EXPONENT, QuantizedWeight, decode_e2m1,
                                          nvfp4_decode_ptx, nvfp4_sum_ptx, quant_matmul_reference, unpack_e2m1)
from pallas_kernels.tensor_parallel import TP, on_axis, per_device, tp_size


# ----------------------------------------------------------------------------- quantize / dequantize


# ----------------------------------------------------------------------------- Pallas kernel


def _load_step(x_ref, x_odd_ref, w_ref, s_ref, n0, step, *, fmt: str, bn: int, bk: int) -> tuple:
    """K step `step`'s operands as stored: activations [Mp, bk] (nvfp4: even and odd columns, each
    [Mp, bk/2]) and the weight tile [bn, bk] still quantized, with its block scales if any.

    Offsets are products of the step index, never quotients: Triton's alignment analysis then
    proves the tile contiguous and aligned, so it loads 16 bytes a thread instead of one."""
    if fmt == "nvfp4":
        half = pl.ds(step * (bk // 2), bk // 2)
        return (x_ref[:, half], x_odd_ref[:, half], w_ref[pl.ds(n0, bn), half],
                s_ref[pl.ds(n0, bn), pl.ds(step * (bk // GROUP), bk // GROUP)])
    tile = (x_ref[:, pl.ds(step * bk, bk)], w_ref[pl.ds(n0, bn), pl.ds(step * bk, bk)])
    if fmt != "fp8_block":
        return tile
    if bk <= BLOCK:  # the K tile sits inside one 128-column scale block: one scale
        return tile + (s_ref[n0 // BLOCK, step // (BLOCK // bk)],)
    return tile + (s_ref[n0 // BLOCK, pl.ds(step * (bk // BLOCK), bk // BLOCK)],)  # or spans whole blocks


# Inline PTX for the decodes a GEMV is bound by on the GPU (interpret mode runs the jnp forms).
# int8 -> float32 without the conversion unit (int-to-float: 16 results a clock per SM on Hopper,
# by the CUDA guide's throughput table): the byte, sign bit flipped, becomes the low byte of float
# 2^23 + (x + 128), and one subtraction leaves x. Both check out on the H200 against the jnp forms
# (bench/kernels.py: every format 1.7e-3 from dequantize-then-dot, bf16 output rounding).
_INT8_TO_F32_PTX = """{
.reg .b32 t, r<4>;
xor.b32 t, $4, 0x80808080;
prmt.b32 r0, t, 0x4B000000, 0x7540;
prmt.b32 r1, t, 0x4B000000, 0x7541;
prmt.b32 r2, t, 0x4B000000, 0x7542;
prmt.b32 r3, t, 0x4B000000, 0x7543;
mov.b32 $0, r0; mov.b32 $1, r1; mov.b32 $2, r2; mov.b32 $3, r3;
sub.f32 $0, $0, 0f4B000080; sub.f32 $1, $1, 0f4B000080;
sub.f32 $2, $2, 0f4B000080; sub.f32 $3, $3, 0f4B000080;
}"""


def _e4m3_to_f16_pairs_ptx(n: int) -> str:
    """PTX that widens the e4m3 byte pairs l0..l{n-1} into f16 pairs h0..h{n-1}."""
    return " ".join(f"cvt.rn.f16x2.e4m3x2 h{i}, l{i};" for i in range(n))


# Four bytes' even columns, then their odd ones, as e5m2 bytes (times 2^-14): the odd columns' bits are
# the even ones' mirrored, so the word is bit-reversed and its bytes put back in order first. Two
# blocks: Pallas lowers an inline-asm call with one result only.
_BYTES_MASK = f"{E5M2_E2M1_MASK * 0x01010101:#x}"  # one code's bits in each byte
_E2M1_TO_E5M2_PTX = (f"and.b32 $0, $1, {_BYTES_MASK};",
                     f"{{\n.reg .b32 t;\nbrev.b32 t, $1; prmt.b32 t, t, 0, 0x0123; and.b32 $0, t, {_BYTES_MASK};\n}}")


def _int8_to_float(w: jax.Array, ptx: bool) -> jax.Array:
    """int8 [bn, k] -> float32."""
    if not ptx:
        return w.astype(jnp.float32)
    [out] = plt.elementwise_inline_asm(_INT8_TO_F32_PTX, args=[w], constraints="=f,=f,=f,=f,r", pack=4,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float32)])
    return out


def _e2m1_pairs(packed: jax.Array, ptx: bool) -> tuple[jax.Array, jax.Array, float]:
    """Packed e2m1 codes [bn, k/2] -> (even, odd) columns as float32 [bn, k/2], and the factor
    they are scaled down by."""
    if not ptx:
        return *map(decode_e2m1, unpack_e2m1(packed)), 1.0

    def transcoded(asm):
        [e5m2] = plt.elementwise_inline_asm(asm, args=[packed], constraints="=r,r", pack=4,  # Triton: signless
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.int8)])
        return jax.lax.bitcast_convert_type(e5m2, jnp.float8_e5m2).astype(jnp.float32)

    even, odd = map(transcoded, _E2M1_TO_E5M2_PTX)
    return even, odd, E2M1_SHRINK


def _dequantized_pairs(step: tuple, g, *, fmt: str, ptx: bool) -> list[tuple[jax.Array, jax.Array, jax.Array | None]]:
    """(activations [Mp, k], float32 weight [bn, k], scalar scale or None) triples whose scaled
    products sum to the step's share of x W^T. Per-channel scales are applied once, after the K
    loop. An fp8 tile stays inside one 128-row scale block: one scale block's scale multiplies the
    tile's partial sum, several (varying along K only) multiply the activations' columns."""
    if fmt in ("int8", "fp8"):
        x, w = step
        return [(x, _int8_to_float(w, ptx) if fmt == "int8" else w.astype(jnp.float32), None)]
    if fmt == "fp8_block":
        x, w, scales = step
        if scales.ndim == 0:
            return [(x, w.astype(jnp.float32), scales)]
        per_column = jnp.broadcast_to(scales[:, None], (scales.shape[0], BLOCK)).reshape(1, x.shape[1])
        return [(x.astype(jnp.float32) * per_column, w.astype(jnp.float32), None)]
    x_even, x_odd, packed, scales = step
    bn, half = packed.shape
    even, odd, shrink = _e2m1_pairs(packed, ptx)
    scales = scales.astype(jnp.float32) * (g * shrink)
    scales = jnp.broadcast_to(scales[:, :, None], (bn, half // (GROUP // 2), GROUP // 2)).reshape(bn, half)
    return [(x_even, even * scales, None), (x_odd, odd * scales, None)]


def _contract(acc: jax.Array, x: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """acc + scale x [Mp, k] w [bn, k]^T. More than one row: a bf16 tensor-core dot into acc
    [Mp, bn]. One row (a dot would pad it to 16): float32 products summed over k into acc [1, bn]."""
    if x.shape[0] > 1:
        part = jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16).T, preferred_element_type=jnp.float32)
        return acc + (part if scale is None else scale * part)
    products = w * (x.astype(jnp.float32) if scale is None else x.astype(jnp.float32) * scale)
    return acc + jnp.sum(products, axis=1)[None, :]


def _kernel(x_ref, x_odd_ref, w_ref, s_ref, g_ref, o_ref, *, fmt: str, bn: int, bk: int, k_steps: int, ptx: bool):
    """Program (i, j): output columns [i bn, (i + 1) bn) over the j-th of the split K ranges."""
    n0 = pl.program_id(0) * bn
    first_step = pl.program_id(1) * k_steps

    def body(i, acc):
        tile = _load_step(x_ref, x_odd_ref, w_ref, s_ref, n0, first_step + i, fmt=fmt, bn=bn, bk=bk)
        for x, w, scale in _dequantized_pairs(tile, g_ref[0], fmt=fmt, ptx=ptx):
            acc = _contract(acc, x, w, scale)
        return acc

    acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((x_ref.shape[0], bn), jnp.float32))
    if fmt in ("int8", "fp8"):
        acc = acc * s_ref[pl.ds(n0, bn)][None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


# ----------------------------------------------------------------------------- one row: packed halves

# One activation row (decode at batch 1) of int8, fp8 (per channel or 128 blocks) or NVFP4 weights.
# Multiply-and-sum in float32 costs 5 or more instructions a weight, and the H200 runs out of
# instruction issue before HBM runs out of bytes. Here one inline-PTX call takes two 32-bit weight
# words, decodes them straight into f16 pairs, multiplies them with f16 activation pairs two at a time
# (fma.f16x2) and adds the sum, in float32 and times the words' scale, to that word pair's accumulator:
# about 3 instructions a weight. f16 keeps the products and their short sums (4 terms a lane; NVFP4 16)
# to 2^-11 when each program's K range of the activation row is first scaled by a power of two, its
# largest |x| into [2^(T-1), 2^T): high enough that small values keep their bits, low enough that no sum
# leaves f16's range (T below; the bound is terms x max |weight| x 2^T). A row kernel scales and pairs
# the row first (one launch where XLA takes three fusions); each GEMV program scales its sums back
# once, after its K loop. Converting the bf16 row inside the GEMV loop instead costs more than the
# row kernel's launch (H200, BENCHMARKS.md).
HALF_FORMATS = ("int8", "fp8", "fp8_block", "nvfp4")

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


def _scale_operands(w: "QuantizedWeight") -> tuple[jax.Array, jax.Array]:
    """The kernels' scale operands: w's scales (NVFP4's stay e4m3, the others float32) and its global
    scale [1] float32 (1 where the format has none). Reshapes and no-op casts: no XLA kernel."""
    g = w.global_scale if w.global_scale is not None else jnp.ones(())
    return (w.scale if w.format == "nvfp4" else w.scale.astype(jnp.float32)), jnp.reshape(g, (1,)).astype(jnp.float32)


def _half_gemv(x: jax.Array, w: "QuantizedWeight", t: "Tiling", interpret: bool) -> jax.Array:
    """The packed-half kernels on one row x [1, K] -> [1, N] in x's dtype."""
    N, K = w.shape
    per_word = VALUES_PER_WORD[w.format]
    x_pairs, post = half_row(x, w.format, t.split_k, interpret)
    words = jax.lax.bitcast_convert_type(w.data.reshape(N, K // per_word, 4), jnp.int32)
    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
    args = (x_pairs, post, words, *_scale_operands(w))
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


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pair_words(num_warps: int) -> int:
    """The fewest weight words a packed-half tile may hold: a word pair for every thread (the PTX
    takes two words a call; with fewer, Triton pairs what it has and the sums come out wrong: NaN
    on the H200 with 8-row NVFP4 tiles of 64 words under 16 warps)."""
    return 2 * 32 * num_warps


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the kernel cuts the work: block_n output columns per program, block_k of K per loop
    step, K split over split_k programs (partial sums added after), Triton's warps and stages;
    with gemv, a single activation row is contracted without a tensor-core dot on rows padded to
    16: by float32 multiply-and-sum, or with packed_halves by f16 pairs (HALF_FORMATS only, a tile of
    at least a weight-word pair a thread). A packed-half GEMV with `rounds` (the GPU's SM count) runs its
    block_n-row programs in whole rounds of one per SM and gives the rows left over to up to one
    smaller program per SM: all programs run at once, so an SM with one program more than the
    others sets the time."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False
    packed_halves: bool = False
    rounds: int = 0

    def row_blocks(self, N: int, step_words: int) -> tuple[int, int, int]:
        """(programs of block_n rows, programs of the rows left after whole rounds of those, their
        rows: a power of two, 0 where nothing is left over) for N output columns, one K range, steps
        of `step_words` weight words. A small program still gives each thread a word pair."""
        blocks = N // self.block_n
        left = blocks % self.rounds if self.rounds and self.split_k == 1 and blocks > self.rounds else 0
        if not left:
            return blocks, 0, 0
        small = next_pow2(max(-(-left * self.block_n // self.rounds), -(-_pair_words(self.num_warps) // step_words)))
        return (blocks, 0, 0) if small >= self.block_n else (blocks - left, left * self.block_n // small, small)

    def fits(self, w: "QuantizedWeight") -> bool:
        """Power-of-two tiles (Triton's blocks) that divide the weight; for fp8 blocks a tile's rows
        also stay inside one 128-row scale block (its columns then span whole 128-column blocks or
        sit inside one)."""
        N, K = w.shape
        pow2 = all(b == next_pow2(b) for b in (self.block_n, self.block_k))
        rows_in_scale_block = w.format != "fp8_block" or BLOCK % self.block_n == 0
        half = not self.packed_halves or (self.gemv and w.format in HALF_FORMATS and self.block_n * self.block_k
                                          >= _pair_words(self.num_warps) * VALUES_PER_WORD[w.format])
        divides = N % self.block_n == 0 and K % (self.block_k * self.split_k) == 0
        return pow2 and divides and rows_in_scale_block and half


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def quant_matmul_pallas(x: jax.Array, w: QuantizedWeight, *, tiling: Tiling = Tiling(),
                        interpret: bool = False) -> jax.Array:
    """The Pallas kernel; same contract as `quant_matmul_reference` for x [M, K] (M <= 64).

    `tiling.fits(w)` must hold.
    """
    M, K = x.shape
    N = w.shape[0]
    t = tiling
    if not t.fits(w):  # a tile past the edge would read and write out of bounds, silently
        raise ValueError(f"tiling {t} does not divide a [{N}, {K}] {w.format} weight (block_n | N, "
                         f"block_k * split_k | K; fp8_block also block_n | 128 and block_k | 128; a "
                         f"packed-half GEMV: one row of {', '.join(HALF_FORMATS)}, "
                         f"a weight-word pair for each of its threads)")
    if M == 1 and t.packed_halves:
        return _half_gemv(x, w, t, interpret)
    Mp = 1 if M == 1 and t.gemv else max(16, next_pow2(M))
    xb = jnp.pad(x.astype(jnp.bfloat16), ((0, Mp - M), (0, 0)))
    if w.format == "nvfp4":
        x_main, x_odd = xb[:, 0::2], xb[:, 1::2]
    else:
        x_main, x_odd = xb, xb  # the odd-column operand is unused
    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # a pointer to the whole array
    args = (x_main, x_odd, w.data, *_scale_operands(w))
    kernel = functools.partial(_kernel, fmt=w.format, bn=t.block_n, bk=t.block_k, k_steps=K // (t.block_k * t.split_k),
                               ptx=not interpret)
    out = pl.pallas_call(
        kernel,  # one K range writes the output in x's dtype; split K writes float32 partial sums
        out_shape=jax.ShapeDtypeStruct((t.split_k, Mp, N), x.dtype if t.split_k == 1 else jnp.float32),
        grid=(N // t.block_n, t.split_k),
        in_specs=[whole(a) for a in args],
        out_specs=pl.BlockSpec((None, Mp, t.block_n), lambda i, j: (j, 0, i)),
        compiler_params=plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name=f"quant_matmul_{w.format}",
    )(*args)
    return out[0, :M] if t.split_k == 1 else jnp.sum(out[:, :M], axis=0).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class TunedTilings:
    """The Triton kernel's tilings for one GPU model, chosen by timing it with cold weights, as in a
    decode step (BENCHMARKS.md, "Weight-only quantized matmuls"). 1-16 bf16 rows of NVFP4 on a GPU
    with TMA run a Mosaic GPU kernel where its tiling fits (`nvfp4_mosaic_matmul`); the NVFP4
    tilings here serve the rest.

    one_row: per format, one activation row (decode at batch 1): the fastest, K unsplit so there
      are no partial sums to add. The dispatcher sets `rounds` to the SM count, so the programs fill
      whole rounds of SMs: a last round that leaves most SMs idle sets the time.
    multiply_and_sum, half_min_bytes: int8 and fp8 take the packed halves only from half_min_bytes
      of weight, where what they save outweighs their row kernel's launch; below, multiply_and_sum.
      NVFP4 takes them at every size.
    few_programs, deep_rows: short, wide weights make too few 16-row programs to keep the SMs' warps
      hiding memory latency (the 27B MLP's down projection [5120, 17408] makes 320). Under
      few_programs programs packed halves run 8 warps each; under half that many, with a big weight,
      1024-wide steps and 16 warps, unsplit, deep_rows rows a program where a format gains from more
      (else 16); where 1024 does not divide K, K split 2 ways with 512-wide steps, else with the
      format's own, else neither. From few_programs programs on, 4 warps and no split are fastest.
    many_rows: 2 to 64 rows, one tiling per format, a compromise across row counts.
    gemv_fallback: one row where the others do not divide K (packed as they are).
    mosaic_gemv_rows: up to this many bf16 rows of NVFP4 the Mosaic f16x2 kernel
      (nvfp4_gemv_mosaic.py), more (up to its MAX_ROWS) the tensor-core one (nvfp4_mma_mosaic.py).
    """

    one_row: dict[str, Tiling]
    multiply_and_sum: Tiling
    half_min_bytes: int
    few_programs: int
    deep_rows: dict[str, int]
    many_rows: dict[str, Tiling]
    gemv_fallback: Tiling
    mosaic_gemv_rows: int


TUNED = {
    "NVIDIA H200": TunedTilings(
        one_row={"int8": Tiling(16, 256, 1, 4, 4, gemv=True, packed_halves=True),
                 "fp8": Tiling(16, 256, 1, 4, 4, gemv=True, packed_halves=True),
                 "fp8_block": Tiling(16, 256, 1, 4, 4, gemv=True, packed_halves=True),
                 "nvfp4": Tiling(16, 512, 1, 4, 3, gemv=True, packed_halves=True)},
        multiply_and_sum=Tiling(16, 512, 1, 4, 3, gemv=True),
        half_min_bytes=32 << 20,
        few_programs=1024,
        deep_rows={"fp8_block": 32},  # faster than 16 for fp8 blocks, slower for NVFP4
        many_rows={"int8": Tiling(64, 256, 1, 4, 3), "fp8": Tiling(64, 256, 1, 4, 3),
                   "fp8_block": Tiling(64, 128, 2, 4, 3), "nvfp4": Tiling(64, 128, 4, 4, 3)},
        gemv_fallback=Tiling(16, 128, 1, 4, 3, gemv=True),
        # at 2 rows the f16x2 kernel is faster at the 27B and 0.8B shapes, at 3 the two trade places
        mosaic_gemv_rows=2,
    ),
}
MEASURED_ON = "NVIDIA H200"  # GPUs without a table of their own take this one's


def tuned_for(device_kind: str) -> TunedTilings:
    """The tilings measured on this GPU model (`jax.Device.device_kind`), else MEASURED_ON's."""
    return TUNED.get(device_kind, TUNED[MEASURED_ON])


def pick_tiling(x: jax.Array, w: QuantizedWeight, rounds: int = 0, tuned: TunedTilings = TUNED[MEASURED_ON]
                ) -> Tiling | None:
    """The measured tiling for x's row count (and w's format) if it divides the shape, else a
    default that does, else None (more than 64 rows, or a shape no tiling divides). A packed-half
    GEMV gets `rounds`, the GPU's SM count (see Tiling)."""
    if x.shape[0] > 64:
        return None
    one_row = tuned.one_row[w.format]
    if w.format != "nvfp4" and w.data.size < tuned.half_min_bytes:
        one_row = tuned.multiply_and_sum
    programs = w.shape[0] // one_row.block_n
    one_rows = (one_row,)
    if programs < tuned.few_programs:
        wide = dataclasses.replace(one_row, num_warps=8) if one_row.packed_halves else one_row
        split = 2 * programs < tuned.few_programs and w.data.size >= tuned.half_min_bytes
        halves = dataclasses.replace(wide, split_k=2)
        deep = dataclasses.replace(one_row, block_n=tuned.deep_rows.get(w.format, one_row.block_n), block_k=1024,
                                   num_warps=16)
        one_rows = (deep, dataclasses.replace(halves, block_k=512), halves, wide) if split else (wide,)
    fallback = dataclasses.replace(tuned.gemv_fallback, packed_halves=one_row.packed_halves)
    tried = (*one_rows, fallback) if x.shape[0] == 1 else (tuned.many_rows[w.format],)
    tiling = next((t for t in (*tried, Tiling()) if t.fits(w)), None)
    return dataclasses.replace(tiling, rounds=rounds) if tiling and tiling.packed_halves else tiling


def has_tma(device) -> bool:
    """Whether a GPU has Hopper's TMA unit (CUDA compute capability 9.0 or later)."""
    return float(getattr(device, "compute_capability", 0) or 0) >= 9.0


def nvfp4_mosaic_matmul(x: jax.Array, w: QuantizedWeight, sm_count: int, tuned: TunedTilings = TUNED[MEASURED_ON]
                        ) -> jax.Array | None:
    """x [M, K] bf16 times an NVFP4 weight through a Mosaic GPU kernel, or None where neither has a
    measured tiling for the shape and rows (then the Triton kernel runs)."""
    if x.shape[0] <= tuned.mosaic_gemv_rows:
        kernel, tiling = nvfp4_gemv_mosaic.nvfp4_gemv_mosaic, nvfp4_gemv_mosaic.pick_mosaic_tiling(*w.shape, sm_count)
    elif x.shape[0] <= nvfp4_mma_mosaic.MAX_ROWS:
        kernel, tiling = nvfp4_mma_mosaic.nvfp4_mma_mosaic, nvfp4_mma_mosaic.pick_mma_tiling(*w.shape, sm_count)
    else:
        return None
    return None if tiling is None else kernel(x, w.data, w.scale, w.global_scale, tiling=tiling)


def quant_matmul(x: jax.Array, w: QuantizedWeight, *, split: str | None = None) -> jax.Array:
    """Dispatcher: x [..., K] -> [..., N]. On a GPU for up to 64 rows a Pallas kernel: bf16 rows of an
    NVFP4 weight on a GPU with TMA take a Mosaic GPU kernel where one has a measured tiling (one or two
    rows the f16x2 GEMV, up to 16 the tensor-core one), everything else the Triton kernel; the
    dequantize-then-dot reference elsewhere.

    split: how a tensor-parallel mesh divides the weight: "out" (column-parallel: each device its
    output channels, x whole), "in" (row-parallel: each device its slice of K, x split alike, the
    partial products summed across devices) or None (replicated)."""
    if split is None or tp_size() == 1:
        return _quant_matmul_local(x, w)
    axis = 0 if split == "out" else 1
    per_row = w.format in ("int8", "fp8")  # one scale per output channel: [N]
    scale = (on_axis(1, 0) if split == "out" else P()) if per_row else on_axis(2, axis)
    w_spec = QuantizedWeight(on_axis(2, axis), scale, None if w.global_scale is None else P(), w.format)
    if split == "out":
        return per_device(_quant_matmul_local, (P(), w_spec), on_axis(x.ndim, -1))(x, w)
    summed = lambda x, w: jax.lax.psum(_quant_matmul_local(x, w), TP)  # noqa: E731
    return per_device(summed, (on_axis(x.ndim, -1), w_spec), P())(x, w)


def _quant_matmul_local(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    flat = x.reshape(-1, x.shape[-1])
    gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0]
    tuned = tuned_for(device.device_kind)
    if gpu and w.format == "nvfp4" and flat.dtype == jnp.bfloat16 and has_tma(device):
        y = nvfp4_mosaic_matmul(flat, w, device.core_count, tuned)
        if y is not None:
            return y.reshape(*x.shape[:-1], w.shape[0])
    tiling = pick_tiling(flat, w, rounds=getattr(device, "core_count", 0) if gpu else 0, tuned=tuned)
    if gpu and tiling is not None:
        return quant_matmul_pallas(flat, w, tiling=tiling).reshape(*x.shape[:-1], w.shape[0])
    return quant_matmul_reference(x, w)
