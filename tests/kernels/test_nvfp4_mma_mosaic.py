"""The tensor-core NVFP4 kernel (Mosaic GPU) on the CPU: it lowers for CUDA at the tilings its rule
picks and for 1-16 activation rows, refuses what it cannot take, its rule picks the measured tilings,
the dispatcher sends each row count to the measured kernel, and the decode-times-scale it feeds the
MMAs is exact in f16. Its numbers are checked on the GPU (bench/kernels.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.nvfp4_gemv_mosaic as gemv
import pallas_kernels.nvfp4_mma_mosaic as mma
from pallas_kernels.nvfp4_mma_mosaic import MmaTiling, nvfp4_mma_mosaic, pick_mma_tiling
from pallas_kernels.quant_formats import E2M1_SHRINK, decode_e2m1, quantize
from pallas_kernels.quant_matmul import MEASURED_ON, TUNED, nvfp4_mosaic_matmul

GEMV_ROWS = TUNED[MEASURED_ON].mosaic_gemv_rows


def _args(M: int, N: int, K: int) -> tuple:
    return (jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((N, K // 2), jnp.uint8),
            jax.ShapeDtypeStruct((N, K // 16), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((), jnp.float32))


@pytest.mark.parametrize("M, N, K, tiling", [(1, 64, 1024, MmaTiling(32, 1, 3)), (3, 64, 2048, MmaTiling(32, 2, 3)),
                                             (8, 16, 1536, MmaTiling(8, 1, 4)), (5, 96, 512, MmaTiling(32, 1, 3)),
                                             (9, 64, 1024, MmaTiling(32, 1, 3)), (16, 16, 2048, MmaTiling(8, 2, 4)),
                                             (4, 100, 1024, MmaTiling(24, 1, 3, 5))])
def test_lowers_to_one_mosaic_gpu_kernel(M, N, K, tiling):
    f = jax.jit(lambda *a: nvfp4_mma_mosaic(*a, tiling=tiling))
    module = f.trace(*_args(M, N, K)).lower(lowering_platforms=("cuda",)).as_text()
    assert module.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "mma.sync.aligned.m16n8k16" in module  # the products go through the tensor cores


@pytest.mark.parametrize("N, K, tiling", [(40, 1024, MmaTiling(32, 1, 3)), (64, 1000, MmaTiling(32, 1, 3)),
                                          (64, 1536, MmaTiling(32, 2, 3)), (12, 512, MmaTiling(12, 1, 3)),
                                          (100, 512, MmaTiling(16, 1, 3, 6))])
def test_refuses_a_weight_its_tiling_does_not_divide(N, K, tiling):
    with pytest.raises(ValueError, match=rf"does not fit an NVFP4 weight \[{N}, {K}\]"):
        nvfp4_mma_mosaic(*(jnp.zeros(a.shape, a.dtype) for a in _args(2, N, K)), tiling=tiling)


@pytest.mark.parametrize("x", [jnp.zeros((4, 1024), jnp.float32), jnp.zeros((17, 1024), jnp.bfloat16)])
def test_takes_one_to_sixteen_bf16_rows_only(x):
    with pytest.raises(ValueError, match=r"1 to 16 bf16 rows \[M, 1024\]"):
        nvfp4_mma_mosaic(x, jnp.zeros((64, 512), jnp.uint8), jnp.zeros((64, 64), jnp.float8_e4m3fn), jnp.ones(()))


@pytest.mark.parametrize("N, K, want", [
    (17408, 5120, MmaTiling(48, 1, 3, 396)),  # 27B MLP up / gate: three CTAs an SM
    (5120, 17408, MmaTiling(40, 2, 3, 132)),  # 27B MLP down: long rows, 1024 values a step
    (3584, 1024, MmaTiling(32, 1, 3, 132)),   # 0.8B MLP up
    (2048, 1024, MmaTiling(32, 1, 3)),    # under half a CTA an SM, over one 8-row CTA
    (1024, 3584, MmaTiling(8, 1, 4)),     # 0.8B MLP down: at most one 8-row CTA an SM
    (17408, 5376, None),                  # K not a multiple of 512
    (5120, 17920, None),                  # long rows not a multiple of 1024
])
def test_rule_picks_the_measured_tiling(N, K, want):
    assert pick_mma_tiling(N, K, sm_count=132) == want


@pytest.mark.parametrize("M, kernel", [(1, "gemv"), (GEMV_ROWS, "gemv"), (GEMV_ROWS + 1, "mma"),
                                       (mma.MAX_ROWS, "mma"), (mma.MAX_ROWS + 1, None)])
def test_dispatcher_sends_each_row_count_to_its_kernel(monkeypatch, M, kernel):
    calls = []
    monkeypatch.setattr(gemv, "nvfp4_gemv_mosaic", lambda x, *a, tiling: calls.append(("gemv", tiling)) or x)
    monkeypatch.setattr(mma, "nvfp4_mma_mosaic", lambda x, *a, tiling: calls.append(("mma", tiling)) or x)
    w = quantize(jnp.ones((3584, 1024), jnp.float32), "nvfp4")
    y = nvfp4_mosaic_matmul(jnp.ones((M, 1024), jnp.bfloat16), w, sm_count=132)
    want = {"gemv": gemv.pick_mosaic_tiling(3584, 1024, 132), "mma": pick_mma_tiling(3584, 1024, 132)}
    assert calls == ([] if kernel is None else [(kernel, want[kernel])])
    assert (y is None) == (kernel is None)  # None: the Triton kernel runs


def test_decoded_weight_times_its_scale_is_exact_in_f16():
    """Every e2m1 value x every finite e4m3 scale x 2^-14 (the decode's) is an f16 with no rounding, so
    folding the group scale into the B operand loses nothing."""
    values = np.asarray(decode_e2m1(jnp.arange(16, dtype=jnp.uint8)), np.float64) / E2M1_SHRINK
    scales = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float64)
    products = np.outer(values, scales[np.isfinite(scales)])
    assert np.array_equal(products.astype(np.float16).astype(np.float64), products)
    assert np.abs(products).max() < 1  # far inside f16's range
