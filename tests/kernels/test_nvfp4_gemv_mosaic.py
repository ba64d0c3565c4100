"""The Mosaic GPU NVFP4 GEMV on the CPU: it lowers for CUDA at every tiling the dispatcher picks and
for 1-8 activation rows, refuses shapes its tiling does not divide, and the dispatcher's rule picks
the measured tilings. Its numbers are checked on the GPU (bench/kernels.py: error against
dequantize-then-dot)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.nvfp4_gemv_mosaic import (MosaicTiling, first_row, nvfp4_gemv_mosaic, pick_mosaic_tiling, rows_fit,
                                              sm_balanced)
from pallas_kernels.quant_matmul import has_tma


def _cuda_module(N: int, K: int, tiling: MosaicTiling, rows: int = 1) -> str:
    args = (jax.ShapeDtypeStruct((rows, K), jnp.bfloat16), jax.ShapeDtypeStruct((N, K // 2), jnp.uint8),
            jax.ShapeDtypeStruct((N, K // 16), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((), jnp.float32))
    f = jax.jit(lambda x, d, s, g: nvfp4_gemv_mosaic(x, d, s, g, tiling=tiling))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("N, K, tiling, rows", [
    (64, 1024, MosaicTiling(32, 1, 3), 1), (32, 2048, MosaicTiling(16, 2, 4), 1), (16, 1536, MosaicTiling(8, 1, 4), 1),
    (64, 1024, MosaicTiling(32, 1, 3), 2), (32, 2048, MosaicTiling(16, 2, 4), 8), (16, 1536, MosaicTiling(8, 1, 4), 3),
    (40, 1024, MosaicTiling(16, 1, 2, 3), 1), (44, 2048, MosaicTiling(8, 2, 4, 6), 5)])
def test_lowers_to_one_mosaic_gpu_kernel(N, K, tiling, rows):
    module = _cuda_module(N, K, tiling, rows)
    assert module.count("stablehlo.custom_call @mosaic_gpu") == 1  # one kernel: no XLA op around it but reshapes


@pytest.mark.parametrize("N, K, ctas", [(40, 1024, 0), (64, 1000, 0), (64, 1536, 0), (49, 1024, 3), (8, 1024, 2)])
def test_refuses_a_weight_its_tiling_does_not_divide(N, K, ctas):
    with pytest.raises(ValueError, match=rf"does not fit an NVFP4 weight \[{N}, {K}\]"):
        _cuda_module(N, K, MosaicTiling(16, 2, 4, ctas))


@pytest.mark.parametrize("N, bn, ctas", [(17408, 44, 396), (5120, 20, 264), (3584, 28, 132), (40, 16, 3), (100, 12, 9),
                                         (64, 16, 4), (64, 16, 0), (17, 17, 5)])
def test_ctas_cover_every_row_inside_the_weight(N, bn, ctas):
    assert rows_fit(N, bn, ctas)
    firsts = [int(first_row(jnp.int32(c), N, bn, ctas)) for c in range(ctas or N // bn)]
    covered = np.zeros(N, bool)
    for r in firsts:
        assert 0 <= r <= N - bn
        covered[r:r + bn] = True
    assert covered.all()


@pytest.mark.parametrize("N, sm_count, rows, multiple", [(17408, 132, 40, 4), (5120, 132, 20, 2), (3584, 132, 40, 4),
                                                          (5120, 132, 44, 8), (2400, 100, 40, 4), (1000, 7, 3, 1)])
def test_sm_balanced_gives_every_sm_the_same_ctas(N, sm_count, rows, multiple):
    ctas, bn = sm_balanced(N, sm_count, rows, multiple)
    assert ctas % sm_count == 0 and bn % multiple == 0 and rows_fit(N, bn, ctas)
    assert bn - -(-N // ctas) < multiple  # no more overlap than the rounding to `multiple` adds
    assert abs(ctas / sm_count - N / (sm_count * rows)) <= 0.5  # the nearest whole number of CTAs an SM


def test_sm_balanced_leaves_small_weights_to_the_plain_grid():
    assert sm_balanced(1024, 132, 40, 4) is None


@pytest.mark.parametrize("N, K, want", [
    (17408, 5120, MosaicTiling(44, 1, 2, 396)),  # 27B MLP up / gate: three CTAs an SM
    (5120, 17408, MosaicTiling(20, 2, 4, 264)),  # 27B MLP down: long rows, 1024 values a step
    (5120, 6144, MosaicTiling(40, 1, 3, 132)),   # 27B GDN out_proj: one CTA an SM
    (3584, 1024, MosaicTiling(16, 1, 4)),    # 0.8B MLP up: rows of two steps keep N / bn CTAs
    (6144, 4096, MosaicTiling(48, 1, 3, 132)),   # 8 steps: balanced
    (1024, 3584, MosaicTiling(8, 1, 4)),     # 0.8B MLP down: under half a CTA an SM
    (17408, 5376, None),                     # K not a multiple of 512: the Triton kernel
    (5120, 17920, None),                     # long rows not a multiple of 1024
    (64, 256 * 512 + 1024, MosaicTiling(8, 2, 4)),  # any length: the row streams with the weights
])
def test_dispatcher_picks_the_measured_tiling(N, K, want):
    assert pick_mosaic_tiling(N, K, sm_count=132) == want


def test_tma_needs_compute_capability_9():
    assert has_tma(SimpleNamespace(compute_capability="9.0"))
    assert not has_tma(SimpleNamespace(compute_capability="8.9"))
    assert not has_tma(SimpleNamespace())  # a CPU or ROCm device


@pytest.mark.parametrize("x", [jnp.zeros((1, 1024), jnp.float32), jnp.zeros((9, 1024), jnp.bfloat16),
                               jnp.zeros((1, 512), jnp.bfloat16)])
def test_takes_one_to_eight_bf16_rows_only(x):
    with pytest.raises(ValueError, match=r"1 to 8 bf16 rows \[M, 1024\]"):
        nvfp4_gemv_mosaic(x, jnp.zeros((64, 512), jnp.uint8), jnp.zeros((64, 64), jnp.float8_e4m3fn), jnp.ones(()))
