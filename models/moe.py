"""The sparse mixture-of-experts block of the Qwen3.5 / Qwen3.6 MoE models (and Qwen3-Next).

A softmax router over E experts picks each token's top k (renormalised when `norm_topk_prob`);
a shared expert, gated per token by sigmoid(shared_expert_gate(x)), runs on every token. Module
attribute names mirror the checkpoint's tensor names (`mlp.gate`, `mlp.experts.gate_up_proj`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate`).

Shapes: N tokens, H hidden, E experts, I expert inner size, k experts a token. `cfg` is the
model's `Qwen3_5Config` (not imported: the model's file imports this one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import MLP, Linear, fuse_linears, project, zeros_param
from pallas_kernels.batch_invariant import elementwise
from pallas_kernels.expert_matmul import expert_swiglu
from pallas_kernels.expert_route import route


class Experts(nnx.Module):
    """Routed experts, fused as in the checkpoint: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, cfg, *, stack=(), dtype=jnp.float32):
        E, H, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = zeros_param((*stack, E, 2 * inner, H), dtype)
        self.down_proj = zeros_param((*stack, E, H, inner), dtype)

    def __call__(self, x: jax.Array, idx: jax.Array, weights: jax.Array) -> jax.Array:
        """x: [N, H]; idx, weights: [N, k] chosen experts and their routing weights -> [N, H]."""
        return expert_swiglu(x, self.gate_up_proj[...], self.down_proj[...], idx, weights)


class SparseMoE(nnx.Module):
    """Softmax router over all experts, top-k renormalised, plus a sigmoid-gated shared expert."""

    ROUTER = ("gate", "shared_expert_gate")  # both read the block's input: one matmul once joined

    def __init__(self, cfg, *, stack=(), dtype=jnp.float32):
        H = cfg.hidden_size
        self.cfg = cfg
        self.gate = Linear(H, cfg.num_experts, stack=stack, dtype=dtype)
        self.experts = Experts(cfg, stack=stack, dtype=dtype)
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size, stack=stack, dtype=dtype)
        self.shared_expert_gate = Linear(H, 1, stack=stack, dtype=dtype)

    def join_router_and_shared_expert(self) -> None:
        """For the decode layout (one layer's own arrays): the router's and the shared gate's rows
        become one matmul, and where the shared expert has the routed experts' size it becomes
        routed expert E, which every token picks with weight sigmoid(shared gate): its gate and
        up rows are appended to the expert stacks. One more pair a token in the expert kernels then
        replaces the shared MLP's matmuls and elementwise kernels. Quantized or tensor-parallel
        shared experts keep their own MLP (their rows do not concatenate with the stacks). In place."""
        shared = self.shared_expert
        parts = (shared.gate_proj, shared.up_proj, shared.down_proj)
        foldable = (shared.gate_proj.weight.shape[-2] == self.cfg.moe_intermediate_size
                    and all(p.format is None and p.shards == 1 for p in parts) and self.gate.shards == 1)
        if foldable:
            experts = self.experts
            gate_up = jnp.concatenate([shared.gate_proj.weight[...], shared.up_proj.weight[...]], axis=-2)
            experts.gate_up_proj = nnx.Param(jnp.concatenate([experts.gate_up_proj[...], gate_up[None]]))
            experts.down_proj = nnx.Param(jnp.concatenate([experts.down_proj[...], shared.down_proj.weight[None]]))
            self.shared_expert = None
        else:
            fuse_linears(shared, shared.PROJECTIONS)
        fuse_linears(self, self.ROUTER)

    def __call__(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router, shared_gate, shared_at = self.router(x)
        folded = self.shared_expert is None  # the shared expert is routed expert E (`join_router_and_shared_expert`)
        cfg = self.cfg
        weights, idx = route(router, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.num_experts,
                             shared_at if folded else None)
        routed = self.experts(x, idx, weights.astype(router.dtype))
        if folded:
            return routed.reshape(shape)
        plus_shared = lambda routed, g, shared: routed + jax.nn.sigmoid(g) * shared  # noqa: E731
        return elementwise(plus_shared, routed, shared_gate, self.shared_expert(x)).reshape(shape)

    def router(self, x: jax.Array) -> tuple[jax.Array, jax.Array, int]:
        """x [N, H] -> (router [N, W] with the E logits first, the shared gate logit [N, 1], the
        gate's channel in router). Joined (`fuse_linears`), the matmul's output as it is."""
        E = self.cfg.num_experts
        fused = getattr(self, "fused", None)
        if fused is not None and fused.shards == 1:
            router = fused(x)
            return router, router[:, E:E + 1], E
        logits, shared_gate = project(self, self.ROUTER, x)
        return jnp.concatenate([logits, shared_gate], axis=-1), shared_gate, E
