"""Weight-only quantization formats: what a `QuantizedWeight` holds, how a float weight is
quantized (`quantize`) and read back (`dequantize`, `quant_matmul_reference`), NVFP4's byte layout
(`E2M1_BITS`) and its conversion from ModelOpt's nibbles, and what the Triton kernels
(quant_matmul_triton.py, quant_half_gemv.py) and the Mosaic GPU kernels (`nvfp4_*_mosaic`) share:
the PTX that decodes NVFP4, the activation pairing of the packed-half GEMV, the scale operands.

Formats of a weight W [N, K] (`QuantizedWeight.format`):
  "int8"      data int8 [N, K], scale float32 [N] (per output channel);
  "fp8"       data float8_e4m3fn [N, K], scale float32 [N];
  "fp8_block" data float8_e4m3fn [N, K], scale float32 [ceil(N/128), ceil(K/128)] (Qwen's FP8
              checkpoints: W = fp8 * weight_scale_inv per 128 x 128 block);
  "nvfp4"     data uint8 [N, K/2] (two e2m1 codes a byte, columns 2j and 2j + 1 in byte j, their
              bits placed as E2M1_BITS says: not ModelOpt's nibbles, see `nvfp4_from_modelopt`),
              scale float8_e4m3fn [N, K/16] (one per 16 values), global_scale float32 [].
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("int8", "fp8", "fp8_block", "nvfp4")

FP8 = jnp.float8_e4m3fn

FP8_MAX = 448.0

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)

BLOCK = 128  # fp8_block scale granularity

GROUP = 16  # nvfp4 scale granularity

@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "scale", "global_scale"],
                   meta_fields=["format"])
@dataclasses.dataclass
class QuantizedWeight:
    """A quantized [N, K] weight; see the module docstring for each format's arrays."""

    data: jax.Array
    scale: jax.Array
    global_scale: jax.Array | None
    format: str

    @property
    def shape(self) -> tuple[int, int]:
        N, K = self.data.shape
        return (N, 2 * K) if self.format == "nvfp4" else (N, K)

def quantize(w: jax.Array, fmt: str) -> QuantizedWeight:
    """Quantize a float weight [N, K] (round to nearest; scales from each group's max)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of {', '.join(FORMATS)}")
    w = jnp.asarray(w, jnp.float32)
    N, K = w.shape
    if fmt == "int8":
        scale = jnp.maximum(jnp.max(jnp.abs(w), axis=1), 1e-12) / 127.0
        return QuantizedWeight(jnp.round(w / scale[:, None]).astype(jnp.int8), scale, None, fmt)
    if fmt == "fp8":
        scale = jnp.maximum(jnp.max(jnp.abs(w), axis=1), 1e-12) / FP8_MAX
        return QuantizedWeight((w / scale[:, None]).astype(FP8), scale, None, fmt)
    if fmt == "fp8_block":
        nb, kb = -(-N // BLOCK), -(-K // BLOCK)
        padded = jnp.pad(w, ((0, nb * BLOCK - N), (0, kb * BLOCK - K)))
        tiles = padded.reshape(nb, BLOCK, kb, BLOCK)
        scale = jnp.maximum(jnp.max(jnp.abs(tiles), axis=(1, 3)), 1e-12) / FP8_MAX
        data = (tiles / scale[:, None, :, None]).reshape(nb * BLOCK, kb * BLOCK)[:N, :K]
        return QuantizedWeight(data.astype(FP8), scale, None, fmt)
    if K % (2 * GROUP):
        raise ValueError(f"nvfp4 needs K divisible by {2 * GROUP}, got K={K}")
    groups = w.reshape(N, K // GROUP, GROUP)
    global_scale = jnp.maximum(jnp.max(jnp.abs(w)), 1e-12) / (6.0 * FP8_MAX)
    scale = (jnp.max(jnp.abs(groups), axis=-1) / 6.0 / global_scale).astype(FP8)
    unit = groups / (scale.astype(jnp.float32)[..., None] * global_scale + 1e-30)
    mag = jnp.argmin(jnp.abs(jnp.abs(unit)[..., None] - E2M1_VALUES), axis=-1)
    codes = (mag + 8 * (unit < 0)).astype(jnp.uint8).reshape(N, K)
    return QuantizedWeight(pack_e2m1(codes[:, 0::2], codes[:, 1::2]), scale, global_scale, fmt)

# Where a byte keeps its two e2m1 codes' bits (sign, e1, e0, m), the even column's first. The even
# column's sit where an e5m2 byte, or an f16's high byte, keeps its sign, low exponent bits and first
# mantissa bit, so `byte & 0x8E` is that column's value times 2^-14 (E2M1_SHRINK) as e5m2. The odd
# column's are the same positions mirrored: bit-reversing the byte decodes it the same way.
# ModelOpt's checkpoints keep the even column in the low nibble, the odd in the high one; the
# loaders convert at the file boundary (`nvfp4_from_modelopt`, `nvfp4_to_modelopt`), because the
# GPU decode takes 7 instructions a word of 8 codes in this layout and 11 from ModelOpt's nibbles.
E2M1_BITS = ((7, 3, 2, 1), (0, 4, 5, 6))

E2M1_SHRINK = 2.0**14  # e2m1 value / its e5m2 (f16) reading

E5M2_E2M1_MASK = 0x8E

def pack_e2m1(even, odd):
    """e2m1 codes (0..15, bit 3 the sign) of the even and odd columns, uint8 [...] (numpy or jax)
    -> their bytes [...] uint8."""
    out = 0
    for codes, positions in zip((even, odd), E2M1_BITS):
        for bit, position in zip((3, 2, 1, 0), positions):
            out = out | (((codes >> bit) & 1) << position)
    return out

def unpack_e2m1(data) -> tuple:
    """Bytes uint8 [...] (numpy or jax) -> the even and odd columns' e2m1 codes, uint8 [...] each."""
    return tuple(functools.reduce(operator.or_, (((data >> position) & 1) << bit for bit, position
                                                 in zip((3, 2, 1, 0), positions))) for positions in E2M1_BITS)

_EVERY_BYTE = np.arange(256, dtype=np.uint8)

_FROM_MODELOPT = pack_e2m1(_EVERY_BYTE & 15, _EVERY_BYTE >> 4)  # a permutation of the 256 bytes

_TO_MODELOPT = np.argsort(_FROM_MODELOPT).astype(np.uint8)

def nvfp4_from_modelopt(packed: np.ndarray) -> np.ndarray:
    """ModelOpt NVFP4 weight bytes (the even column in the low nibble) -> this module's layout."""
    return _FROM_MODELOPT[np.asarray(packed)]

def nvfp4_to_modelopt(data: np.ndarray) -> np.ndarray:
    """This module's NVFP4 bytes -> ModelOpt's (the even column in the low nibble)."""
    return _TO_MODELOPT[np.asarray(data)]

def decode_e2m1(codes: jax.Array) -> jax.Array:
    """e2m1 codes (0..15, bit 3 = sign) -> float32 values {0, .5, 1, 1.5, 2, 3, 4, 6} with sign.

    Built from bits, no arithmetic: magnitude (e, f) with e > 0 is 2^(e-1) (1 + f/2), whose
    float32 bits are (e + 126) << 23 | f << 22 = (code << 22) + (126 << 23); e = 0 is 0 or 0.5.
    """
    c = codes.astype(jnp.int32)
    mag = c & 7
    bits = jnp.where(mag >= 2, (mag << 22) + (126 << 23), jnp.where(mag == 1, 126 << 23, 0))
    return jax.lax.bitcast_convert_type(bits | ((c & 8) << 28), jnp.float32)

def dequantize(w: QuantizedWeight) -> jax.Array:
    """The float32 weight [N, K]."""
    N, K = w.shape
    if w.format in ("int8", "fp8"):
        return w.data.astype(jnp.float32) * w.scale[:, None]
    if w.format == "fp8_block":
        s = jnp.repeat(jnp.repeat(w.scale, BLOCK, axis=0), BLOCK, axis=1)[:N, :K]
        return w.data.astype(jnp.float32) * s
    codes = jnp.stack(unpack_e2m1(w.data), axis=-1).reshape(N, K)
    s = jnp.repeat(w.scale.astype(jnp.float32), GROUP, axis=1) * w.global_scale
    return decode_e2m1(codes) * s

def scale_operands(w: QuantizedWeight) -> tuple[jax.Array, jax.Array]:
    """The kernels' scale operands: w's scales (NVFP4's stay e4m3, the others float32) and its global
    scale [1] float32 (1 where the format has none). Reshapes and no-op casts: no XLA kernel."""
    g = w.global_scale if w.global_scale is not None else jnp.ones(())
    return (w.scale if w.format == "nvfp4" else w.scale.astype(jnp.float32)), jnp.reshape(g, (1,)).astype(jnp.float32)

def quant_matmul_reference(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [..., K] (bf16 or f32) -> x W^T [..., N] in x's dtype, float32 accumulation."""
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), dequantize(w))
    return y.astype(x.dtype)

# 4 x 128 x 2^6 and 4 x 448 x 2^5 < 65504; NVFP4's sums (16 x 6 x 2^-14 x 2^15) are far inside, but
# the activations themselves must stay under 65504. Its products sit 2^14 lower than the values
# (E2M1_SHRINK), so they stay normal f16 down to 2^-15 of the range's largest |x|; smaller ones keep
# an absolute error under 2^-25, against products up to 12.
X_TOP_EXPONENT = {"int8": 6, "fp8": 5, "fp8_block": 5, "nvfp4": 15}

VALUES_PER_WORD = {"int8": 4, "fp8": 4, "fp8_block": 4, "nvfp4": 8}

# Which values of a weight word each activation pair array holds, (low lane, high lane).
X_PAIR_VALUES = {"int8": ((0, 1), (2, 3)), "fp8": ((0, 1), (2, 3)), "fp8_block": ((0, 1), (2, 3)),
                 "nvfp4": ((0, 4), (2, 6), (7, 3), (5, 1))}

# NVFP4: two words are one 16-value group. Masking a word with 0x8E008E00 leaves f16 pairs (times
# 2^-14) of values (2, 6), its bytes 1 and 3; shifted left a byte first, (0, 4); bit-reversed, the
# odd columns (5, 1), and reversed and shifted, (7, 3) (E2M1_BITS). They meet activation arrays A
# (values 0, 4), B (2, 6), C (7, 3), D (5, 1) in one chain of eight fma.f16x2; its two lanes are added
# in f16, and the sum times $12, the group's scale, goes to the accumulator.
_F16_PAIR_MASK = f"{E5M2_E2M1_MASK * 0x01000100:#x}"  # one code's bits in each f16 lane

def nvfp4_decode_ptx(words: tuple[str, str], halves: list[str]) -> str:
    """PTX decoding a group's two e2m1 words (operands `words`) into its eight f16 pairs `halves`
    (h0..h7: word 0's pairs (0, 4), (2, 6), (7, 3), (5, 1), then word 1's); scratch registers t, u."""
    return "\n".join(
        f"shl.b32 t, {w}, 8; and.b32 {halves[4 * i]}, t, {_F16_PAIR_MASK}; "
        f"and.b32 {halves[4 * i + 1]}, {w}, {_F16_PAIR_MASK}; "
        f"brev.b32 u, {w}; shl.b32 t, u, 8; and.b32 {halves[4 * i + 2]}, t, {_F16_PAIR_MASK}; "
        f"and.b32 {halves[4 * i + 3]}, u, {_F16_PAIR_MASK};"
        for i, w in enumerate(words))

def nvfp4_sum_ptx(halves: list[str], pairs: list[str]) -> str:
    """PTX of one group's sum into f16 `a`: the eight fma.f16x2 of `halves` (nvfp4_decode_ptx's order)
    with the activation pair words `pairs` (A0 A1 B0 B1 C0 C1 D0 D1), its two lanes added; scratch p, b."""
    chain = [f"fma.rn.f16x2 p, {h}, {pairs[2 * (i % 4) + i // 4]}, p;" for i, h in enumerate(halves)]
    chain[0] = f"mul.f16x2 p, {halves[0]}, {pairs[0]};"
    return " ".join(chain[:4]) + "\n" + " ".join(chain[4:]) + "\nmov.b32 {a, b}, p; add.rn.f16 a, a, b;"
