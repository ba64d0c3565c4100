"""The routed-expert Pallas kernels in interpret mode against the gathering reference, with
repeated experts within a token and across tokens, and bf16 weights; the grouped kernels and
their plain-JAX tiles on ragged groups (experts with no pair, every pair on one expert, T = 1
and T = 2,048); and the grouped path's program holding nothing of pairs x experts size."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import relative_error

from pallas_kernels.expert_grouped import (GroupTiling, expert_swiglu_grouped_pallas, expert_swiglu_tiled,
                                           group_by_expert, tile_count)
from pallas_kernels.expert_matmul import (Tiling, expert_swiglu, expert_swiglu_pallas, expert_swiglu_reference,
                                          kernel_fits)

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")

SMALL = Tiling(block_n=16, block_k=32)


def random_experts(N: int, k: int, *, E=6, H=64, inner=32, seed=0, dtype=jnp.float32, ids=None):
    """Tokens, experts and routing at random; ids may repeat across tokens (E is small)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, H))
    gate_up = rng.normal(size=(E, 2 * inner, H)) / np.sqrt(H)
    down = rng.normal(size=(E, H, inner)) / np.sqrt(inner)
    if ids is None:
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    weights = rng.dirichlet(np.ones(k), size=N)
    def cast(a):
        return jnp.asarray(a, dtype)

    return cast(x), cast(gate_up), cast(down), jnp.asarray(ids), cast(weights)


@pytest.mark.parametrize("N, k", [(1, 2), (3, 2), (4, 4)])
def test_kernels_match_the_gathering_reference(N, k):
    args = random_experts(N, k, seed=N * 10 + k)
    out = expert_swiglu_pallas(*args, tiling=SMALL, interpret=True)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert relative_error(out, expert_swiglu_reference(*args)) < 1e-5


GROUPED = GroupTiling(block_m=16, block_n=16, block_k=32)


def ragged_routings(rng, N: int, k: int, E: int) -> dict[str, np.ndarray]:
    """Routings whose groups are ragged: most experts empty, one expert holding a pair of every
    token, every expert used, and plain random choices."""
    few = np.stack([rng.choice(3, k, replace=False) for _ in range(N)])  # experts 3.. get no pair
    one_hot = np.stack([np.r_[E - 1, rng.choice(E - 1, k - 1, replace=False)] for _ in range(N)])
    spread = np.stack([rng.permutation(E)[:k] for _ in range(N)])
    return {"few experts": few, "one expert in every token": one_hot, "random": spread}


@pytest.mark.parametrize("N", [1, 2, 37])
def test_grouped_kernels_match_the_reference_on_ragged_groups(N):
    rng = np.random.default_rng(N)
    for name, ids in ragged_routings(rng, N, 3, 6).items():
        args = random_experts(N, 3, seed=N, ids=ids.astype(np.int32))
        want = expert_swiglu_reference(*args)
        assert relative_error(expert_swiglu_grouped_pallas(*args, tiling=GROUPED, interpret=True), want) < 1e-5, name
        assert relative_error(expert_swiglu_tiled(*args, block_m=16), want) < 1e-5, name


def test_grouped_kernels_at_a_2048_token_prefill():
    """Many tiles per expert, and every pair on expert 0 for one token in eight."""
    rng = np.random.default_rng(7)
    ids = np.stack([rng.choice(8, 2, replace=False) for _ in range(2048)]).astype(np.int32)
    ids[::8, 0], ids[::8, 1] = 0, 1
    args = random_experts(2048, 2, E=8, H=32, inner=16, seed=7, ids=ids)
    want = expert_swiglu_reference(*args)
    tiling = GroupTiling(block_m=64, block_n=16, block_k=16)
    assert relative_error(expert_swiglu_grouped_pallas(*args, tiling=tiling, interpret=True), want) < 1e-5
    assert relative_error(expert_swiglu_tiled(*args, block_m=64), want) < 1e-5


def test_groups_put_each_pair_in_a_tile_of_its_expert():
    rng = np.random.default_rng(3)
    E, bm = 10, 4
    ids = jnp.asarray(np.stack([rng.choice(E, 3, replace=False) for _ in range(11)]), jnp.int32)
    g = group_by_expert(ids, E, bm)
    flat = np.asarray(ids).reshape(-1)
    tile_expert, row_pair, pair_row = map(np.asarray, g)
    assert len(tile_expert) == tile_count(flat.size, E, bm)
    assert (row_pair[pair_row] == np.arange(flat.size)).all()  # each pair has its own row
    assert (tile_expert[pair_row // bm] == flat).all()  # in a tile of its expert
    assert np.count_nonzero(row_pair < flat.size) == flat.size  # every other row is padding
    used_tiles = np.ceil(np.bincount(flat, minlength=E) / bm).sum()
    assert (tile_expert[:int(used_tiles)] >= 0).all() and (tile_expert[int(used_tiles):] == -1).all()


def test_bf16_grouped_kernels_accumulate_in_float32():
    args = random_experts(20, 2, seed=6, dtype=jnp.bfloat16)
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    out = expert_swiglu_grouped_pallas(*args, tiling=GROUPED, interpret=True)
    assert out.dtype == jnp.bfloat16
    assert relative_error(out, expert_swiglu_reference(*f32)) < 1e-2


def test_the_dispatcher_routes_prefill_through_the_tiles():
    args = random_experts(300, 4, E=16, seed=8)
    assert relative_error(expert_swiglu(*args), expert_swiglu_reference(*args)) < 1e-5


def largest_buffer(lowered_text: str) -> int:
    """Elements of the largest tensor type named in a lowered program's text."""
    import re

    sizes = [np.prod([int(d) for d in dims.split("x")[:-1]]) for dims in re.findall(r"tensor<([0-9x]+[a-z0-9]+)>",
                                                                                       lowered_text)]
    return int(max(sizes))


def test_the_grouped_program_holds_nothing_of_pairs_times_experts():
    """At 35B-A3B's expert shape (256 experts, H 2048, I 512, top 8), a 2,048-token prefill's
    program: no buffer near pairs x experts x hidden (32,768 x 256 x 2,048); the largest is the
    weight stack itself or a rows x hidden activation."""
    E, H, inner, N, k = 256, 2048, 512, 2048, 8
    spec = lambda *s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d)  # noqa: E731
    shapes = (spec(N, H), spec(E, 2 * inner, H), spec(E, H, inner), spec(N, k, d=jnp.int32), spec(N, k))
    pairs = N * k
    for fn in (jax.jit(lambda *a: expert_swiglu_grouped_pallas(*a, tiling=GroupTiling(), interpret=True)),
               jax.jit(expert_swiglu)):
        text = fn.lower(*shapes).as_text()
        assert largest_buffer(text) <= max(E * 2 * inner * H, (pairs + E * 64) * H), fn


def test_bf16_weights_accumulate_in_float32():
    args = random_experts(2, 2, seed=5, dtype=jnp.bfloat16)
    out = expert_swiglu_pallas(*args, tiling=SMALL, interpret=True)
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    assert out.dtype == jnp.bfloat16
    assert relative_error(out, expert_swiglu_reference(*f32)) < 1e-2  # bf16 output rounding (2^-8) and bf16 inputs


def test_kernel_shapes():
    _, gate_up, down, *_ = random_experts(1, 2)
    assert kernel_fits(gate_up, down, SMALL)
    assert not kernel_fits(gate_up[:, :48], down, SMALL)  # 2I = 48 is no power of two


@pytest.mark.parametrize("renormalise", [True, False])
def test_routing_matches_softmax_then_top_k(renormalise):
    """HF's rule: softmax over all experts, top k, renormalised over them when norm_topk_prob."""
    from pallas_kernels.expert_route import route

    logits = jnp.asarray(np.random.default_rng(9).normal(size=(33, 16)) * 3, jnp.float32)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    want_ids = np.argsort(-probs, axis=-1)[:, :4]
    want = np.take_along_axis(probs, want_ids, axis=-1)
    if renormalise:
        want = want / want.sum(-1, keepdims=True)
    weights, ids = route(logits, 4, renormalise, 16)
    assert (np.asarray(ids) == want_ids).all()
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-6)
