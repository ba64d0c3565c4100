"""Weight-only quantized matmul y = x W^T for decode and verify batches (1 to 64 rows).

Formats of a weight W [N, K] (`QuantizedWeight.format`):
  "int8"      data int8 [N, K], scale float32 [N] (per output channel);
  "fp8"       data float8_e4m3fn [N, K], scale float32 [N];
  "fp8_block" data float8_e4m3fn [N, K], scale float32 [ceil(N/128), ceil(K/128)] (Qwen's FP8
              checkpoints: W = fp8 * weight_scale_inv per 128 x 128 block);
  "nvfp4"     data uint8 [N, K/2] (two e2m1 codes a byte, the even column in the low nibble),
              scale float8_e4m3fn [N, K/16] (one per 16 values), global_scale float32 [].

`quant_matmul` is the dispatcher: the Pallas (Triton) kernel on a GPU, dequantize-then-dot
elsewhere. The kernel runs one program per block of BN output channels (and per K range when K
is split), loops over K in BK tiles, dequantizes each weight tile in registers and accumulates in
float32. A single activation row (decode at batch 1) is contracted by multiply-and-sum; more rows
by a bf16 tensor-core dot on rows padded to 16 (Triton's smallest). At one row on the H200 this
streams 78-88% of the measured HBM ceiling for int8 / fp8 / fp8 blocks (BENCHMARKS.md).
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
    codes = jnp.stack([w.data & 15, w.data >> 4], axis=-1).reshape(N, K)
    s = jnp.repeat(w.scale.astype(jnp.float32), GROUP, axis=1) * w.global_scale
    return decode_e2m1(codes) * s


def quant_matmul_reference(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [..., K] (bf16 or f32) -> x W^T [..., N] in x's dtype, float32 accumulation."""
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), dequantize(w))
    return y.astype(x.dtype)


# ----------------------------------------------------------------------------- Pallas kernel


def _load_step(x_ref, x_odd_ref, w_ref, s_ref, n0, k0, *, fmt: str, bn: int, bk: int) -> tuple:
    """One K step's operands as stored: activations [Mp, bk] (nvfp4: even and odd columns, each
    [Mp, bk/2]) and the weight tile [bn, bk] still quantized, with its block scales if any."""
    if fmt == "nvfp4":
        half = pl.ds(k0 // 2, bk // 2)
        return (x_ref[:, half], x_odd_ref[:, half], w_ref[pl.ds(n0, bn), half],
                s_ref[pl.ds(n0, bn), pl.ds(k0 // GROUP, bk // GROUP)])
    step = (x_ref[:, pl.ds(k0, bk)], w_ref[pl.ds(n0, bn), pl.ds(k0, bk)])
    return step + (s_ref[n0 // BLOCK, k0 // BLOCK],) if fmt == "fp8_block" else step


def _dequantized_pairs(step: tuple, g, *, fmt: str) -> list[tuple[jax.Array, jax.Array]]:
    """(activations [Mp, k], float32 weight [bn, k]) pairs whose products sum to the step's share
    of x W^T (per-channel scales are applied once, after the K loop)."""
    if fmt in ("int8", "fp8"):
        x, w = step
        return [(x, w.astype(jnp.float32))]
    if fmt == "fp8_block":
        x, w, scale = step
        return [(x, w.astype(jnp.float32) * scale)]
    x_even, x_odd, packed, scales = step
    bn, half = packed.shape
    scales = scales.astype(jnp.float32) * g
    scales = jnp.broadcast_to(scales[:, :, None], (bn, half // (GROUP // 2), GROUP // 2)).reshape(bn, half)
    return [(x_even, decode_e2m1(packed & 15) * scales), (x_odd, decode_e2m1(packed >> 4) * scales)]


def _contract(acc: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
    """acc [Mp, bn] + x [Mp, k] w[bn, k]^T: one row by float32 multiply-and-sum (a dot would pad
    it to 16), more by a bf16 tensor-core dot."""
    if x.shape[0] == 1:
        return acc + jnp.sum(w * x.astype(jnp.float32), axis=1)[None, :]
    return acc + jnp.dot(x, w.astype(jnp.bfloat16).T, preferred_element_type=jnp.float32)


def _kernel(x_ref, x_odd_ref, w_ref, s_ref, g_ref, o_ref, *, fmt: str, bn: int, bk: int, k_steps: int):
    """Program (i, j): output columns [i bn, (i + 1) bn) over the j-th of the split K ranges."""
    n0 = pl.program_id(0) * bn
    k_first = pl.program_id(1) * k_steps * bk

    def body(i, acc):
        step = _load_step(x_ref, x_odd_ref, w_ref, s_ref, n0, k_first + i * bk, fmt=fmt, bn=bn, bk=bk)
        for x, w in _dequantized_pairs(step, g_ref[0], fmt=fmt):
            acc = _contract(acc, x, w)
        return acc

    acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((x_ref.shape[0], bn), jnp.float32))
    if fmt in ("int8", "fp8"):
        acc = acc * s_ref[pl.ds(n0, bn)][None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the kernel cuts the work: block_n output columns per program, block_k of K per loop
    step, K split over split_k programs (partial sums added after), Triton's warps and stages;
    with gemv, a single activation row is contracted by multiply-and-sum instead of a
    tensor-core dot on rows padded to 16."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False

    def fits(self, w: "QuantizedWeight") -> bool:
        """The tiles divide the weight; for fp8 blocks a tile also stays inside one 128 x 128
        scale block (the kernel reads one scale per tile)."""
        N, K = w.shape
        inside_scale_block = w.format != "fp8_block" or (BLOCK % self.block_n == 0 and BLOCK % self.block_k == 0)
        return N % self.block_n == 0 and K % (self.block_k * self.split_k) == 0 and inside_scale_block


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
                         f"block_k * split_k | K; fp8_block also block_n | 128 and block_k | 128)")
    Mp = 1 if M == 1 and t.gemv else max(16, next_pow2(M))
    xb = jnp.pad(x.astype(jnp.bfloat16), ((0, Mp - M), (0, 0)))
    if w.format == "nvfp4":
        x_main, x_odd = xb[:, 0::2], xb[:, 1::2]
    else:
        x_main, x_odd = xb, xb  # the odd-column operand is unused
    g = jnp.reshape(w.global_scale if w.global_scale is not None else jnp.ones(()), (1,)).astype(jnp.float32)
    scale = w.scale if w.format == "nvfp4" else w.scale.astype(jnp.float32)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # a pointer to the whole array
    args = (x_main, x_odd, w.data, scale, g)
    kernel = functools.partial(_kernel, fmt=w.format, bn=t.block_n, bk=t.block_k, k_steps=K // (t.block_k * t.split_k))
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


# The fastest tilings per format on the H200 (27B MLP matrix [17408, 5120], BENCHMARKS.md): for one
# activation row (decode at batch 1; a multiply-and-sum GEMV except NVFP4, whose dot was faster)
# and for 2 to 64 rows.
MEASURED_TILINGS = {
    "int8": (Tiling(16, 512, 5, 4, 3, gemv=True), Tiling(64, 256, 1, 4, 3)),
    "fp8": (Tiling(16, 512, 5, 4, 3, gemv=True), Tiling(64, 256, 1, 4, 3)),
    "fp8_block": (Tiling(32, 128, 8, 4, 3, gemv=True), Tiling(64, 128, 4, 4, 4)),
    "nvfp4": (Tiling(64, 128, 4, 4, 3), Tiling(32, 128, 4, 4, 3)),
}
GEMV_FALLBACK = Tiling(16, 128, 8, 4, 3, gemv=True)  # one row, where the measured tiling does not divide


def pick_tiling(x: jax.Array, w: QuantizedWeight) -> Tiling | None:
    """The measured tiling for w's format and x's row count if it divides the shape, else a default
    that does, else None (more than 64 rows, or a shape no tiling divides)."""
    if x.shape[0] > 64:
        return None
    one_row, many_rows = MEASURED_TILINGS[w.format]
    gemv_fallback = () if w.format == "nvfp4" else (GEMV_FALLBACK,)  # NVFP4's GEMV measured slower than its dot
    for tiling in (one_row, *gemv_fallback, Tiling()) if x.shape[0] == 1 else (many_rows, Tiling()):
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
