"""The Mosaic GPU NVFP4 GEMV on the CPU: it lowers for CUDA at every tiling the dispatcher picks and
for 1-8 activation rows, refuses shapes its tiling does not divide, and the dispatcher's rule picks
the measured tilings. Its numbers are checked on the GPU (bench/kernels.py: error against
dequantize-then-dot)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.nvfp4_gemv_mosaic import MosaicTiling, nvfp4_gemv_mosaic, pick_mosaic_tiling
from pallas_kernels.quant_matmul import has_tma


def _cuda_module(N: int, K: int, tiling: MosaicTiling, rows: int = 1) -> str:
    args = (jax.ShapeDtypeStruct((rows, K), jnp.bfloat16), jax.ShapeDtypeStruct((N, K // 2), jnp.uint8),
            jax.ShapeDtypeStruct((N, K // 16), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((), jnp.float32))
    f = jax.jit(lambda x, d, s, g: nvfp4_gemv_mosaic(x, d, s, g, tiling=tiling))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("N, K, tiling, rows", [(64, 1024, MosaicTiling(32, 1, 3), 1), (32, 2048, MosaicTiling(16, 2, 4), 1),
                                                (16, 1536, MosaicTiling(8, 1, 4), 1), (64, 1024, MosaicTiling(32, 1, 3), 2),
                                                (32, 2048, MosaicTiling(16, 2, 4), 8), (16, 1536, MosaicTiling(8, 1, 4), 3)])
def test_lowers_to_one_mosaic_gpu_kernel(N, K, tiling, rows):
    module = _cuda_module(N, K, tiling, rows)
    assert module.count("stablehlo.custom_call @mosaic_gpu") == 1  # one kernel: no XLA op around it but reshapes


@pytest.mark.parametrize("N, K", [(40, 1024), (64, 1000), (64, 1536)])
def test_refuses_a_weight_its_tiling_does_not_divide(N, K):
    with pytest.raises(ValueError, match=rf"does not fit an NVFP4 weight \[{N}, {K}\]"):
        _cuda_module(N, K, MosaicTiling(16, 2, 4))


@pytest.mark.parametrize("N, K, want", [
    (17408, 5120, MosaicTiling(32, 1, 3)),   # 27B MLP up / gate: many rows
    (5120, 17408, MosaicTiling(16, 2, 4)),   # 27B MLP down: long rows, 1024 values a step
    (3584, 1024, MosaicTiling(16, 1, 4)),    # 0.8B MLP up
    (1024, 3584, MosaicTiling(8, 1, 4)),     # 0.8B MLP down: under one 16-row CTA an SM
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
