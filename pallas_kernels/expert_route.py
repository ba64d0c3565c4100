"""A token's routing in one kernel: the top k of its router logits, their weights, and the shared
expert's slot, ready for the expert kernels.

Per token n with router logits l [E] (and, with a shared expert folded in as expert E, its gate g;
both read from the router matmul's output as it lies, so no slice of it is copied out):
    scores = l                      when the top k are renormalised (softmax is monotonic)
           = softmax(l)             otherwise
    ids[n, :k]     = the k highest scores, highest first, lower index first among equals
    weights[n, :k] = softmax over those k logits (renormalised) or their softmax probabilities
    ids[n, k] = E, weights[n, k] = sigmoid(g)                          (shared expert folded in)

In XLA this is a sort kernel for top-k, a softmax fusion and a concatenation or two a layer, each
a launch of ~2-4 us around almost no work; at batch-1 decode they cost as much as reading an
expert. One program per token holds its E logits and takes the maximum k times (each time
masking the one taken), which is top-k with `jax.lax.top_k`'s order and tie rule.
`route_reference` (the model's formula) is what the kernel is tested against and what runs off
the GPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.batch_invariant import row_tiled
from pallas_kernels.tensor_parallel import tp_size


def route_reference(router: jax.Array, k: int, renormalise: bool, num_experts: int,
                    shared_at: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Top-k routing in XLA ops.

    Args:
      router: [N, W] the router's output: the E = num_experts logits in channels [0, E), and
        with a folded shared expert its gate logit at channel shared_at (the router and the
        shared gate are one matmul in the decode layout, so the kernel reads its output whole).
      k: experts a token. renormalise: the checkpoint's `norm_topk_prob`.
    Returns:
      (weights [N, k'] float32, ids [N, k'] int32), k' = k + 1 with a shared gate (slot k is
      expert E with weight sigmoid(gate)), else k.
    """
    logits = router[:, :num_experts].astype(jnp.float32)
    if renormalise:  # the softmax of the top k logits: the other experts' terms cancel
        top, ids = jax.lax.top_k(logits, k)
        weights = jax.nn.softmax(top, axis=-1)
    else:
        weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if shared_at is None:
        return weights, ids.astype(jnp.int32)
    shared_id = jnp.full((logits.shape[0], 1), num_experts, jnp.int32)
    shared_weight = jax.nn.sigmoid(router[:, shared_at:shared_at + 1].astype(jnp.float32))
    return jnp.concatenate([weights, shared_weight], axis=-1), jnp.concatenate([ids.astype(jnp.int32), shared_id], -1)


def _route_kernel(router_ref, ids_ref, w_ref, *, k: int, renormalise: bool, E: int, shared_at: int | None):
    """Token n: router [N, W] whole -> its slots of ids, weights [N * k']."""
    n = pl.program_id(0)
    slots = k + (shared_at is not None)
    logits = router_ref[n, pl.ds(0, E)].astype(jnp.float32)
    expert = jnp.arange(E, dtype=jnp.int32)
    peak = jnp.max(logits)
    exps = jnp.exp(logits - peak)
    scores = logits if renormalise else exps / jnp.sum(exps)
    chosen = []
    for _ in range(k):  # the maximum k times, each taken one masked out
        best = jnp.max(scores)
        i = jnp.min(jnp.where(scores == best, expert, E))
        chosen.append((i, best))
        scores = jnp.where(expert == i, -jnp.inf, scores)
    if renormalise:  # the softmax of the chosen logits; exp(best - peak) is that expert's term of exps
        terms = [jnp.exp(best - peak) for _, best in chosen]
        total = sum(terms)
        chosen = [(i, term / total) for (i, _), term in zip(chosen, terms)]
    for t, (i, weight) in enumerate(chosen):  # unrenormalised, a chosen score is its probability
        ids_ref[n * slots + t] = i
        w_ref[n * slots + t] = weight
    if shared_at is not None:
        ids_ref[n * slots + k] = jnp.int32(E)
        w_ref[n * slots + k] = jax.nn.sigmoid(router_ref[n, shared_at].astype(jnp.float32))


def _whole(shape) -> pl.BlockSpec:
    return pl.BlockSpec(shape, lambda n: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=("k", "renormalise", "num_experts", "shared_at", "interpret"))
def route_pallas(router: jax.Array, k: int, renormalise: bool, num_experts: int, shared_at: int | None = None, *,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The kernel; same arguments and result as `route_reference`. E a power of two (`kernel_fits`)."""
    N = router.shape[0]
    slots = k + (shared_at is not None)
    ids, weights = pl.pallas_call(
        functools.partial(_route_kernel, k=k, renormalise=renormalise, E=num_experts, shared_at=shared_at),
        out_shape=[jax.ShapeDtypeStruct((N * slots,), jnp.int32), jax.ShapeDtypeStruct((N * slots,), jnp.float32)],
        grid=(N,),
        in_specs=[_whole(router.shape)],
        out_specs=[_whole((N * slots,))] * 2,
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="expert_route",
    )(router)
    return weights.reshape(N, slots), ids.reshape(N, slots)


def kernel_fits(num_experts: int) -> bool:
    """Expert counts the kernel takes: a power of two (a Triton block holds a token's logits)."""
    return num_experts >= 2 and num_experts & (num_experts - 1) == 0


def route(router: jax.Array, k: int, renormalise: bool, num_experts: int,
          shared_at: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Dispatcher for routing (shapes as `route_reference`): the kernel on a GPU on one device, the
    reference elsewhere. A program sees one token, so a token's routing is the same bits whatever
    else shares the pass; off the GPU batch-invariant mode runs the reference on fixed tiles of
    tokens (`row_tiled`), where top-k and the softmax's sum then run as the same program."""
    if jax.default_backend() == "gpu" and tp_size() == 1 and kernel_fits(num_experts):
        return route_pallas(router, k, renormalise, num_experts, shared_at)
    return row_tiled(lambda r: route_reference(r, k, renormalise, num_experts, shared_at), router)
