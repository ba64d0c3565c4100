"""Weight-only quantized matmul y = x W^T for decode and verify batches (1 to 64 rows): the dispatcher.

Formats, their bit layouts and decode PTX: `quant_formats`.

`quant_matmul` runs a Pallas kernel on a GPU: 1-16 bf16 rows of NVFP4 on Hopper the Mosaic GPU
kernels of nvfp4_gemv_mosaic.py and nvfp4_mma_mosaic.py, the rest the Triton kernel
(quant_matmul_triton.py; one row by packed f16 pairs: quant_half_gemv.py) with a tiling measured for
the GPU model (`TUNED`, `pick_tiling`); dequantize-then-dot elsewhere, and on a tensor-parallel mesh
per device. Measured one-row figures are in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import nvfp4_gemv_mosaic, nvfp4_mma_mosaic
from pallas_kernels.quant_formats import QuantizedWeight, quant_matmul_reference
from pallas_kernels.quant_matmul_triton import quant_matmul_pallas
from pallas_kernels.quant_tiling import Tiling
from pallas_kernels.tensor_parallel import TP, on_axis, per_device, tp_size


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
