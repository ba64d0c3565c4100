"""The Gated DeltaNet mixer of the Qwen3.5 / Qwen3.6 (and Qwen3-Next) hybrid models: a causal
depthwise convolution + SiLU over the q, k, v projections, then the gated delta rule over a
per-head state (computed in float32, cached in `Qwen3_5Model.state_dtype`), and a gated
RMSNorm on its output. Attribute names mirror the checkpoint's tensor names
(`linear_attn.in_proj_qkv`, `conv1d`, `A_log`, `dt_bias`, `norm`, ...).

Its cache is `GDNCache` (conv window and state); a verify pass leaves the cache as it was and
returns `GDNPending`, from which `commit_gdn` keeps any prefix. `cfg` is the model's
`Qwen3_5Config` (not imported: the model's file imports this one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import Batch, Linear, project, split_channels, zeros_param
from pallas_kernels.batch_invariant import elementwise, invariant_rows
from pallas_kernels.gdn_chunked import CHUNK, gdn_chunked
from pallas_kernels.gdn_decode import gdn_decode_pallas, use_decode_kernel
from pallas_kernels.gdn_recurrent import gdn_recurrent, gdn_verify
from pallas_kernels.rms_norm import rms_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNCache:
    """One pattern position's GDN layers: conv window [G, B, K-1, conv_dim] (pre-conv inputs,
    oldest first) and recurrent state [G, B, nv, dk, dv] in the model's `state_dtype`."""

    conv: jax.Array
    state: jax.Array



@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNPending:
    """What a GDN layer keeps from a verify pass so the caller can commit any prefix of it.

    seq: [B, K-1+T, conv_dim] the old conv window followed by the T new conv inputs.
    "checkpoint" rollback keeps states [B, T, nv, dk, dv], the state after every token;
    "replay" keeps the delta-rule inputs k [B, T, nk, dk], v [B, T, nv, dv], decay and beta
    [B, T, nv], and re-runs the accepted prefix from the committed state at commit time.
    """

    seq: jax.Array
    states: jax.Array | None = None
    k: jax.Array | None = None
    v: jax.Array | None = None
    decay: jax.Array | None = None
    beta: jax.Array | None = None



class GatedRMSNorm(nnx.Module):
    """GDN output norm: rmsnorm(o) * w * silu(z) per value head, plain weight (no 1 + w)."""

    def __init__(self, dim: int, eps: float, *, stack=()):
        self.weight = zeros_param((*stack, dim), jnp.float32)
        self.eps = eps

    def __call__(self, o: jax.Array, z: jax.Array, dtype) -> jax.Array:
        def apply(o, z):
            of = o.astype(jnp.float32)
            n = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + self.eps)
            return (n * self.weight[...] * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)

        return rms_norm(apply, o, self.weight[...], self.eps, z, out_dtype=dtype)


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet linear attention: causal depthwise conv + SiLU, then the gated delta rule."""

    PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def __init__(self, cfg, *, stack=(), dtype=jnp.float32):
        H, nv = cfg.hidden_size, cfg.linear_num_value_heads
        self.cfg = cfg
        self.in_proj_qkv = Linear(H, cfg.conv_dim, stack=stack, dtype=dtype)
        self.in_proj_z = Linear(H, cfg.value_dim, stack=stack, dtype=dtype)
        self.in_proj_b = Linear(H, nv, stack=stack, dtype=dtype)
        self.in_proj_a = Linear(H, nv, stack=stack, dtype=dtype)
        self.conv1d = zeros_param((*stack, cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), dtype)
        self.A_log = zeros_param((*stack, nv), jnp.float32)
        self.dt_bias = zeros_param((*stack, nv), jnp.float32)
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, stack=stack)
        self.out_proj = Linear(cfg.value_dim, H, stack=stack, dtype=dtype)
        self.shards = 1  # static: tensor-parallel devices, over which the conv channels come grouped

    def __call__(self, x, batch: Batch, cache: GDNCache, g, kv_len: int, rollback=None):
        """x: [B, T, H]; continues repeat g's conv window and state. One fused kernel a decode
        token on a GPU (`gdn_decode_pallas`); otherwise chunked when T >= 64, token by token below.

        Returns ([B, T, H], cache, pending). With rollback=None the cache advances by each row's
        n_valid tokens and pending is None. With rollback "checkpoint" or "replay" (a verify
        pass) the cache is left as it was and `GDNPending` says how to commit any prefix.
        """
        del kv_len
        cfg = self.cfg
        B, T, _ = x.shape
        nv, dv, K = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        valid = batch.valid_for(T)
        if rollback is None and use_decode_kernel(T, K, cache.state, self.shards):
            proj, gates_at, z = self.decode_projections(x)
            o, states, window = gdn_decode_pallas(proj, cache.conv, self.conv1d[...][:, 0, :], self.A_log[...],
                                                  self.dt_bias[...], valid[:, 0], cache.state, g,
                                                  num_k_heads=cfg.linear_num_key_heads, gates_at=gates_at)
            cache = GDNCache(jax.lax.dynamic_update_index_in_dim(cache.conv, window, g, 0), states)
            pending, o = None, o[:, None]
        else:
            mixed, z, b, a = project(self, self.PROJECTIONS, x)  # mixed: [B, T, conv_dim]
            window = jax.lax.dynamic_index_in_dim(cache.conv, g, keepdims=False)
            seq = jnp.concatenate([window.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
            o, states, pending = self.delta_rule(seq, b, a, valid, cache.state, g, rollback)
            if rollback is None:
                cache = GDNCache(jax.lax.dynamic_update_index_in_dim(cache.conv, conv_window(seq, batch.n_valid, K),
                                                                     g, 0), states)
        o = self.norm(o, z.reshape(B, T, nv, dv), x.dtype).reshape(B, T, nv * dv)
        return self.out_proj(o), cache, pending

    def decode_projections(self, x: jax.Array) -> tuple[jax.Array, tuple[int, int], jax.Array]:
        """One token's projections as the fused decode kernel reads them: x [B, 1, H] -> (proj
        [B, W] with the conv inputs first, where b and a start in it, z [B, 1, value_dim]). Joined
        projections (`fuse_linears`) are the matmul's output as it is, [qkv | z | b | a | padding];
        separate ones are joined [qkv | b | a]."""
        cfg = self.cfg
        C, nv = cfg.conv_dim, cfg.linear_num_value_heads
        if getattr(self, "fused", None) is not None:
            proj = self.fused(x)[:, 0]
            return proj, (C + cfg.value_dim, C + cfg.value_dim + nv), proj[:, None, C:C + cfg.value_dim]
        mixed, z, b, a = project(self, self.PROJECTIONS, x)
        return jnp.concatenate([mixed, b, a], axis=-1)[:, 0], (C, C + nv), z

    def delta_rule(self, seq, b, a, valid, states, g, rollback):
        """The convolution, gates and gated delta rule as separate XLA ops and kernels (what the
        fused decode kernel computes in one): seq [B, K-1+T, C], b, a [B, T, nv], valid [B, T],
        from repeat g of states [G, B, nv, dk, dv] -> (o [B, T, nv, dv], the states with repeat g's
        after the pass (as they were under a rollback), pending)."""
        cfg = self.cfg
        B, T = valid.shape
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        w = self.conv1d[...][:, 0, :]  # [C, K]
        taps = [seq[:, s : s + T] for s in range(K)]
        u = elementwise(lambda *taps: jax.nn.silu(sum(x * w[:, s] for s, x in enumerate(taps))), *taps, lead=2)
        q, k, v = split_channels(u, (nk * dk, nk * dk, nv * dv), self.shards)
        q, k, v = q.reshape(B, T, nk, dk), k.reshape(B, T, nk, dk), v.reshape(B, T, nv, dv)
        beta = elementwise(lambda b: jax.nn.sigmoid(b.astype(jnp.float32)), b, lead=2)  # write strength
        decay = elementwise(lambda a: -jnp.exp(self.A_log[...]) * jax.nn.softplus(a.astype(jnp.float32) +
                                                                                 self.dt_bias[...]), a, lead=2)
        beta, decay = jnp.where(valid[..., None], beta, 0.0), jnp.where(valid[..., None], decay, 0.0)
        if rollback == "checkpoint":
            o, per_token = gdn_verify(q, k, v, decay, beta, states, g, keep_states=True)
            return o, states, GDNPending(seq, states=per_token)
        if rollback == "replay":
            (o,) = gdn_verify(q, k, v, decay, beta, states, g)
            return o, states, GDNPending(seq, k=k, v=v, decay=decay, beta=beta)
        # o comes back in v's dtype (chunked, as HF's) or float32 (recurrent); the norm reads float32
        rule = gdn_chunked if T >= CHUNK and invariant_rows() is None else gdn_recurrent
        o, state = rule(q, k, v, decay, beta, jax.lax.dynamic_index_in_dim(states, g, keepdims=False))
        return o, jax.lax.dynamic_update_index_in_dim(states, state, g, 0), None


def conv_window(seq: jax.Array, n_used: jax.Array, K: int) -> jax.Array:
    """The K-1 conv inputs ending at each row's last used token: seq [B, K-1+T, C], n_used [B]
    -> [B, K-1, C]."""
    idx = n_used[:, None] + jnp.arange(K - 1)[None, :]
    return jnp.take_along_axis(seq, idx[:, :, None], axis=1)


def commit_gdn(cache: GDNCache, pending: GDNPending, n_used: jax.Array, K: int) -> GDNCache:
    """Keep the first n_used [B] tokens (0..T) of a verify pass, for every repeat g at once.

    The delta rule cannot be run backwards, so this selects the kept per-token state
    ("checkpoint") or re-runs the kept prefix from the committed state ("replay").
    """
    G, B, T = pending.seq.shape[0], pending.seq.shape[1], pending.seq.shape[2] - (K - 1)
    window = jax.vmap(conv_window, in_axes=(0, None, None))(pending.seq, n_used, K)
    if pending.states is not None:
        last = jnp.maximum(n_used - 1, 0)[None, :, None, None, None, None]
        picked = jnp.take_along_axis(pending.states, jnp.broadcast_to(last, (G, B, 1, *pending.states.shape[3:])),
                                     axis=2)
        state = jnp.where((n_used > 0)[None, :, None, None, None], picked[:, :, 0], cache.state)  # 0 kept: unchanged
    else:
        def flat(x):
            return x.reshape(G * B, *x.shape[2:])
        keep = (jnp.arange(T)[None, :] < n_used[:, None])[None, :, :, None]  # [1, B, T, 1]
        decay, beta = jnp.where(keep, pending.decay, 0.0), jnp.where(keep, pending.beta, 0.0)
        k = flat(pending.k)
        _, state = gdn_recurrent(k, k, flat(pending.v), flat(decay), flat(beta), flat(cache.state))
        state = state.reshape(cache.state.shape)
    return GDNCache(window.astype(cache.conv.dtype), state)
