"""Random-weight models of the released Qwen3.5 / Qwen3.6 geometries, made on the device.

Every bench script builds its target here. No checkpoint is written: at 27B the bf16 weights are
54 GB, too much for the GPU machine's disk and minutes of host RNG; drawing them with
`jax.random` straight into device memory takes seconds. Each parameter follows the test
checkpoints' distribution (`spec_jax.writing.random_checkpoint.init_rule`: norm weights random too, so a
missing `1 + w` cannot hide) and the activations stay O(1) through 64 layers.

    from bench.models import geometry_config, random_model
    model = random_model(geometry_config("27b"))          # Qwen3_5Model, bf16, on the device
    llm = LLM(model=model, max_model_len=4096)
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import Linear, quantize_linears
from models.qwen3_5 import Qwen3_5Config, Qwen3_5Model
from spec_jax.engine.config import default_decode_layout
from spec_jax.loading.source import param_sources
from spec_jax.writing.random_checkpoint import init_rule, random_drafter_config

# qwen35_architecture.md section 1.2; "tiny" is a CPU smoke-test size.
GEOMETRIES = {
    "0.8b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True),
    "2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
               num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True),
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                num_key_value_heads=4, linear_num_value_heads=48, tie_word_embeddings=False),
    "35b-a3b": dict(hidden_size=2048, intermediate_size=512, num_hidden_layers=40, num_attention_heads=16,
                    num_key_value_heads=2, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512, tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True, vocab_size=4096),
}


def geometry_config(name: str, layers: int | None = None) -> Qwen3_5Config:
    """A released geometry with its MTP head. layers: keep only this many decoder layers (a whole
    number of the 4-layer pattern), for quick probes whose per-layer cost scales to the full depth."""
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; expected one of {', '.join(GEOMETRIES)}")
    cfg = Qwen3_5Config(**{"vocab_size": 248320, "head_dim": 256, "linear_num_key_heads": 16,
                           "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                           "mtp_num_hidden_layers": 1, "eos_token_id": (248044,), **GEOMETRIES[name]})
    return cfg if layers is None else dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=())


@partial(jax.jit, static_argnames=("rule", "shape", "dtype"))
def _draw(key, *, rule, shape, dtype):
    kind, a, b = rule
    if kind == "uniform":
        return jax.random.uniform(key, shape, jnp.float32, a, b).astype(dtype)
    return (a + b * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_network(make, name_of, *, seed: int = 0) -> nnx.Module:
    """`make()` (an NNX module) with every float parameter drawn on the default device by the rule
    for its checkpoint name `name_of(path)`; integer parameters (a d2t table) are zeros."""
    gdef, state = nnx.split(nnx.eval_shape(make))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    values = []
    for i, (keypath, want) in enumerate(leaves):
        shape, dtype = tuple(want.shape), jnp.dtype(want.dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            values.append(jnp.zeros(shape, dtype))
            continue
        rule = init_rule(name_of(tuple(k.key for k in keypath)), shape)
        values.append(_draw(jax.random.fold_in(jax.random.key(seed), i), rule=rule, shape=shape, dtype=dtype))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, values))
    return nnx.merge(gdef, state)


def random_model(cfg: Qwen3_5Config, dtype="bfloat16", *, seed: int = 0, quantization: str | None = None,
                 verbose: bool = True) -> Qwen3_5Model:
    """A `Qwen3_5Model` of `cfg` whose every parameter is drawn on the default device.

    dtype: the projections' dtype (norm weights, A_log, dt_bias stay float32, as loaded).
    quantization: a `quant_matmul` format for every decoder projection (weight-only), or None.
    """
    t = time.perf_counter()
    model = random_network(lambda: Qwen3_5Model(cfg, dtype=jnp.dtype(dtype)),
                           lambda path: param_sources(path, cfg)[0], seed=seed)
    if quantization:
        paths = {path: quantization for path, m in nnx.iter_modules(model)
                 if isinstance(m, Linear) and path[0] == "layers"}
        quantize_linears(model, paths)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    if verbose:
        print(f"random model: {cfg.num_hidden_layers} layers, {param_bytes(model) / 1e9:.1f} GB on "
              f"{jax.devices()[0].device_kind} in {time.perf_counter() - t:.1f} s", flush=True)
    return model


DRAFT_MODEL_GEOMETRY = "0.8b"  # the draft_model method's drafter: the smallest model of the family


def random_drafter(method: str, target: Qwen3_5Config, dtype="bfloat16", *, block_size: int | None = None,
                   seed: int = 1, **fields):
    """A random drafter network of `method` that fits `target`, made on the device: DFlash /
    DSpark / EAGLE-3 as `spec_jax.writing.random_checkpoint.random_drafter_config` shapes them
    (with `fields` of its config set: sliding layers, DFlash2), and for draft_model a
    Qwen3.5-0.8B geometry (the family's vocabulary, so its drafts are target ids)."""
    if method == "draft_model":
        cfg = dataclasses.replace(geometry_config(DRAFT_MODEL_GEOMETRY), mtp_num_hidden_layers=0,
                                  vocab_size=target.vocab_size)
        return random_model(cfg, dtype, seed=seed, verbose=False)
    from models.dflash import DFlashDraft
    from models.eagle3 import Eagle3Draft

    cfg = dataclasses.replace(random_drafter_config(method, target, block_size=block_size), **fields)
    network = DFlashDraft if method in ("dflash", "dspark") else Eagle3Draft
    name_of = lambda path: ".".join(map(str, path)) + (".weight" if path[-1] == "embed_tokens" else "")  # noqa: E731
    return random_network(lambda: network(cfg, dtype=jnp.dtype(dtype)), name_of, seed=seed)


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def param_bytes(model: Qwen3_5Model) -> int:
    return nbytes(nnx.state(model))


def chosen_experts(cfg: Qwen3_5Config, tokens: int) -> float:
    """Expected distinct experts a layer reads for `tokens` tokens each choosing num_experts_per_tok
    of num_experts uniformly (a random model's router is near uniform): E (1 - (1 - k/E)^tokens)."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    return float(k) if tokens == 1 else E * (1 - (1 - k / E) ** tokens)


def streamed_bytes(model: Qwen3_5Model, tokens: int = 1) -> int:
    """Weight bytes one decode step of `tokens` tokens (a batch of rows) must read: every decoder
    layer and the lm_head; of an untied embedding only one row (not counted); of the routed experts
    the share chosen (`chosen_experts`); not the MTP head."""
    cfg = model.cfg
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        size = leaf.size * leaf.dtype.itemsize
        if keys[0] == "mtp" or (keys[0] == "embed_tokens" and not cfg.tie_word_embeddings):
            continue
        if "experts" in keys:
            size = int(size * chosen_experts(cfg, tokens) / cfg.num_experts)
        total += size
    return total


def active_params(model: Qwen3_5Model) -> int:
    """Decoder-layer parameters one token is multiplied by: all but the unchosen routed experts."""
    cfg = model.cfg
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        if keys[0] in ("layers", "groups"):
            total += leaf.size * cfg.num_experts_per_tok // cfg.num_experts if "experts" in keys else leaf.size
    return total


def expert_bytes(model: Qwen3_5Model) -> int:
    """Bytes of every routed expert of every decoder layer."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]
    return sum(leaf.size * leaf.dtype.itemsize for path, leaf in flat
               if "experts" in [str(getattr(k, "key", k)) for k in path] and str(path[0].key) != "mtp")


def random_prompts(cfg: Qwen3_5Config, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, length).tolist() for _ in range(batch)]


def add_layout_flag(ap: argparse.ArgumentParser) -> None:
    """--rolled-layers: keep the loaded stacked layout under a rolled scan on the GPU too, to compare
    with the engine's decode layout (`Qwen3_5Model.use_decode_layout`)."""
    ap.add_argument("--rolled-layers", action="store_true", help=add_layout_flag.__doc__.split(": ", 1)[1])


def layout_name(rolled: bool) -> str:
    return "rolled" if rolled else ("decode layout" if default_decode_layout() else "rolled")
