"""The Triton kernel of the weight-only quantized matmul y = x W^T (1 to 64 rows), `quant_matmul_pallas`.

It runs one program per block of BN output columns (and per K range when K is split), loops over K
in BK tiles, dequantizes each weight tile in registers and accumulates in float32. A single
activation row (decode at batch 1) is contracted by float32 multiply-and-sum, or by packed f16 pairs
in their own kernels (quant_half_gemv.py); more rows by a bf16 tensor-core dot on rows padded to 16
(Triton's smallest). On the GPU the int8 and e2m1 decodes are inline PTX bit tricks (int8 without
the int-to-float converter; e2m1 codes stored where f16 and e5m2 keep those bits, so a mask decodes
them). The tiling is the caller's (`Tiling`; the dispatcher's tuned ones: quant_matmul.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.quant_formats import (BLOCK, E2M1_SHRINK, E5M2_E2M1_MASK, GROUP, QuantizedWeight, decode_e2m1,
                                          scale_operands, unpack_e2m1)
from pallas_kernels.quant_half_gemv import half_gemv
from pallas_kernels.quant_tiling import HALF_FORMATS, Tiling, next_pow2


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
        return half_gemv(x, w, t, interpret)
    Mp = 1 if M == 1 and t.gemv else max(16, next_pow2(M))
    xb = jnp.pad(x.astype(jnp.bfloat16), ((0, Mp - M), (0, 0)))
    if w.format == "nvfp4":
        x_main, x_odd = xb[:, 0::2], xb[:, 1::2]
    else:
        x_main, x_odd = xb, xb  # the odd-column operand is unused
    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # a pointer to the whole array
    args = (x_main, x_odd, w.data, *scale_operands(w))
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
