"""Weight-only quantized matmul y = x W^T for decode and verify batches (1 to 64 rows).

Formats of a weight W [N, K] (`QuantizedWeight.format`):
  "int8"      data int8 [N, K], scale float32 [N] (per output channel);
  "fp8"       data float8_e4m3fn [N, K], scale float32 [N];
  "fp8_block" data float8_e4m3fn [N, K], scale float32 [ceil(N/128), ceil(K/128)] (Qwen's FP8
              checkpoints: W = fp8 * weight_scale_inv per 128 x 128 block);
  "nvfp4"     data uint8 [N, K/2] (two e2m1 codes a byte, the even column in the low nibble),
              scale float8_e4m3fn [N, K/16] (one per 16 values), global_scale float32 [].

`quant_matmul` is the dispatcher: the Pallas (Triton) kernel on a GPU, dequantize-then-dot
elsewhere. The kernel runs one program per block of BN output channels, loops over K in BK
tiles, dequantizes each weight tile in registers to bf16 and accumulates in float32; activation
rows are padded to 16 (Triton's smallest dot).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

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


# ----------------------------------------------------------------------------- quantize / dequantize


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
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return QuantizedWeight(packed, scale, global_scale, fmt)


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """e2m1 codes (0..15, bit 3 = sign) -> float32 values {0, .5, 1, 1.5, 2, 3, 4, 6} with sign."""
    c = codes.astype(jnp.int32)
    exponent, mantissa = (c >> 1) & 3, (c & 1).astype(jnp.float32)
    normal = jnp.exp2((exponent - 1).astype(jnp.float32)) * (1.0 + 0.5 * mantissa)
    magnitude = jnp.where(exponent == 0, 0.5 * mantissa, normal)
    return jnp.where((c & 8) != 0, -magnitude, magnitude)


def dequantize(w: QuantizedWeight) -> jax.Array:
    """The float32 weight [N, K]."""
    N, K = w.shape
    if w.format in ("int8", "fp8"):
        return w.data.astype(jnp.float32) * w.scale[:, None]
    if w.format == "fp8_block":
        s = jnp.repeat(jnp.repeat(w.scale, BLOCK, axis=0), BLOCK, axis=1)[:N, :K]
        return w.data.astype(jnp.float32) * s
    codes = jnp.stack([w.data & 15, w.data >> 4], axis=-1).reshape(N, K)
    s = jnp.repeat(w.scale.astype(jnp.float32), GROUP, axis=1) * w.global_scale
    return decode_e2m1(codes) * s


def quant_matmul_reference(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [..., K] (bf16 or f32) -> x W^T [..., N] in x's dtype, float32 accumulation."""
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), dequantize(w))
    return y.astype(x.dtype)


# ----------------------------------------------------------------------------- Pallas kernel


def _tile(w_ref, s_ref, g_ref, n0, k0, *, fmt: str, bn: int, bk: int) -> jax.Array:
    """Dequantize weight tile [bn, bk] at (n0, k0) to bf16 (per-channel scales applied later)."""
    if fmt in ("int8", "fp8"):
        return w_ref[pl.ds(n0, bn), pl.ds(k0, bk)].astype(jnp.float32).astype(jnp.bfloat16)
    if fmt == "fp8_block":
        scale = s_ref[n0 // BLOCK, k0 // BLOCK]
        return (w_ref[pl.ds(n0, bn), pl.ds(k0, bk)].astype(jnp.float32) * scale).astype(jnp.bfloat16)
    packed = w_ref[pl.ds(n0, bn), pl.ds(k0 // 2, bk // 2)]  # [bn, bk/2]
    scales = s_ref[pl.ds(n0, bn), pl.ds(k0 // GROUP, bk // GROUP)].astype(jnp.float32) * g_ref[0]
    scales = jnp.broadcast_to(scales[:, :, None], (bn, bk // GROUP, GROUP // 2)).reshape(bn, bk // 2)
    lo = decode_e2m1(packed & 15) * scales  # even columns
    hi = decode_e2m1(packed >> 4) * scales  # odd columns
    return lo.astype(jnp.bfloat16), hi.astype(jnp.bfloat16)


def _kernel(x_ref, x_odd_ref, w_ref, s_ref, g_ref, o_ref, *, fmt: str, bn: int, bk: int, k_steps: int):
    """Program (i, j): output columns [i bn, (i + 1) bn) over the j-th of the split K ranges."""
    n0 = pl.program_id(0) * bn
    k_first = pl.program_id(1) * k_steps * bk
    m = x_ref.shape[0]

    def body(i, acc):
        k0 = k_first + i * bk
        if fmt == "nvfp4":
            lo, hi = _tile(w_ref, s_ref, g_ref, n0, k0, fmt=fmt, bn=bn, bk=bk)
            x_even = x_ref[:, pl.ds(k0 // 2, bk // 2)]
            x_odd = x_odd_ref[:, pl.ds(k0 // 2, bk // 2)]
            acc += jnp.dot(x_even, lo.T, preferred_element_type=jnp.float32)
            return acc + jnp.dot(x_odd, hi.T, preferred_element_type=jnp.float32)
        tile = _tile(w_ref, s_ref, g_ref, n0, k0, fmt=fmt, bn=bn, bk=bk)
        return acc + jnp.dot(x_ref[:, pl.ds(k0, bk)], tile.T, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((m, bn), jnp.float32))
    if fmt in ("int8", "fp8"):
        acc = acc * s_ref[pl.ds(n0, bn)][None, :]
    o_ref[...] = acc


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the kernel cuts the work: block_n output columns per program, block_k of K per loop
    step, K split over split_k programs (partial sums added after), Triton's warps and stages."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def fits(self, w: "QuantizedWeight") -> bool:
        N, K = w.shape
        return N % self.block_n == 0 and K % (self.block_k * self.split_k) == 0


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def quant_matmul_pallas(x: jax.Array, w: QuantizedWeight, *, tiling: Tiling = Tiling(),
                        interpret: bool = False) -> jax.Array:
    """The Pallas kernel; same contract as `quant_matmul_reference` for x [M, K] (M <= 64).

    `tiling.fits(w)` must hold (fp8_block: block_n and block_k divide 128).
    """
    M, K = x.shape
    N = w.shape[0]
    t = tiling
    if not t.fits(w):  # a tile past the edge would read and write out of bounds, silently
        raise ValueError(f"tiling {t} does not divide a [{N}, {K}] weight (block_n | N, block_k * split_k | K)")
    Mp = max(16, next_pow2(M))
    xb = jnp.pad(x.astype(jnp.bfloat16), ((0, Mp - M), (0, 0)))
    if w.format == "nvfp4":
        x_main, x_odd = xb[:, 0::2], xb[:, 1::2]
    else:
        x_main, x_odd = xb, xb[:, :1]
    g = jnp.reshape(w.global_scale if w.global_scale is not None else jnp.ones(()), (1,)).astype(jnp.float32)
    scale = w.scale if w.format == "nvfp4" else w.scale.astype(jnp.float32)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # a pointer to the whole array
    args = (x_main, x_odd, w.data, scale, g)
    partial_sums = pl.pallas_call(
        functools.partial(_kernel, fmt=w.format, bn=t.block_n, bk=t.block_k, k_steps=K // (t.block_k * t.split_k)),
        out_shape=jax.ShapeDtypeStruct((t.split_k, Mp, N), jnp.float32),
        grid=(N // t.block_n, t.split_k),
        in_specs=[whole(a) for a in args],
        out_specs=pl.BlockSpec((None, Mp, t.block_n), lambda i, j: (j, 0, i)),
        compiler_params=plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name=f"quant_matmul_{w.format}",
    )(*args)
    return jnp.sum(partial_sums[:, :M], axis=0).astype(x.dtype)


# The fastest tiling per format at M <= 8 on the H200 (27B MLP matrix, BENCHMARKS.md).
MEASURED_TILINGS = {
    "int8": Tiling(64, 256, 1, 4, 3),
    "fp8": Tiling(64, 256, 1, 4, 3),
    "fp8_block": Tiling(64, 128, 4, 4, 4),
    "nvfp4": Tiling(32, 128, 4, 4, 3),
}


def pick_tiling(x: jax.Array, w: QuantizedWeight) -> Tiling | None:
    """The measured tiling for w's format if it fits the shape, else the default one, else None
    (more than 64 rows, or a shape no tiling divides)."""
    if x.shape[0] > 64:
        return None
    for tiling in (MEASURED_TILINGS[w.format], Tiling()):
        if tiling.fits(w):
            return tiling
    return None


def quant_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """Dispatcher: x [..., K] -> [..., N]. The Pallas kernel on a GPU for up to 64 rows, the
    dequantize-then-dot reference otherwise."""
    flat = x.reshape(-1, x.shape[-1])
    tiling = pick_tiling(flat, w)
    if jax.default_backend() == "gpu" and tiling is not None:
        return quant_matmul_pallas(flat, w, tiling=tiling).reshape(*x.shape[:-1], w.shape[0])
    return quant_matmul_reference(x, w)
