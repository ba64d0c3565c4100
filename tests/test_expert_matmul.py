"""The routed-expert Pallas kernels in interpret mode against the gathering reference, with
repeated experts within a token and across tokens, and bf16 weights."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.expert_matmul import (Tiling, expert_swiglu_grouped, expert_swiglu_pallas, expert_swiglu_reference,
                                          kernel_fits)

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")

SMALL = Tiling(block_n=16, block_k=32)


def random_experts(N: int, k: int, *, E=6, H=64, inner=32, seed=0, dtype=jnp.float32):
    """Tokens, experts and routing at random; ids may repeat across tokens (E is small)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, H))
    gate_up = rng.normal(size=(E, 2 * inner, H)) / np.sqrt(H)
    down = rng.normal(size=(E, H, inner)) / np.sqrt(inner)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    weights = rng.dirichlet(np.ones(k), size=N)
    cast = lambda a: jnp.asarray(a, dtype)
    return cast(x), cast(gate_up), cast(down), jnp.asarray(ids), cast(weights)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("N, k", [(1, 2), (3, 2), (4, 4)])
def test_kernels_match_the_gathering_reference(N, k):
    args = random_experts(N, k, seed=N * 10 + k)
    out = expert_swiglu_pallas(*args, tiling=SMALL, interpret=True)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert rel(out, expert_swiglu_reference(*args)) < 1e-5


def test_grouped_matmul_over_sorted_pairs_matches_the_reference():
    args = random_experts(9, 3, seed=2)  # 27 pairs over 6 experts: every expert repeats
    assert rel(expert_swiglu_grouped(*args), expert_swiglu_reference(*args)) < 1e-5


def test_bf16_weights_accumulate_in_float32():
    args = random_experts(2, 2, seed=5, dtype=jnp.bfloat16)
    out = expert_swiglu_pallas(*args, tiling=SMALL, interpret=True)
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    assert out.dtype == jnp.bfloat16
    assert rel(out, expert_swiglu_reference(*f32)) < 1e-2  # bf16 output rounding (2^-8) and bf16 inputs


def test_kernel_shapes():
    _, gate_up, down, *_ = random_experts(1, 2)
    assert kernel_fits(gate_up, down, SMALL)
    assert not kernel_fits(gate_up[:, :48], down, SMALL)  # 2I = 48 is no power of two
