"""Sliding-window and causal drafter layers (DFlash, DSpark native and Speculators, EAGLE-3) and
z-lab's DFlash2 (non-causal sliding layers with convolutions, a candidate selector): each
layout's config resolves to vLLM's per-layer masks; the drafter, its bounded cache written a few
positions at a time, matches a NumPy forward written from the formats' definitions (z-lab's mask:
a key at k is visible to a query at p iff p - k < W, and k <= p when causal); after decoding, the
engine's drafter state gives what that forward gives over the committed sequence; greedy
speculation equals speculation off; DFlash2's drafts are its selector's walk."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DRAFT_GREEDY as GREEDY
from helpers import DRAFTER, DSPARK, FIXED_K, TINY, assert_greedy_equals_plain, drafter_spec, relative_error
from flax import nnx
from safetensors.numpy import load_file

from models.dflash import DFlashConfig
from models.drafter_attention import LayerAttention
from models.eagle3 import Eagle3Config
from models.layers import Batch
from models.qwen3_5 import init_cache
from spec_jax import SamplingParams
from spec_jax.loading.drafters import load_dflash, load_eagle3
from spec_jax.writing.random_checkpoint import write_dflash_checkpoint, write_eagle3_checkpoint

S, F = "sliding_attention", "full_attention"
FIVE = dataclasses.replace(DRAFTER, num_hidden_layers=5)
BLOCK_CASES = {  # name: (drafter, layout, each layer's expected (window, causal))
    "dflash-all-sliding": (dataclasses.replace(DRAFTER, layer_types=(S, S), sliding_window=5), "dflash",
                           [(5, True)] * 2),
    "dflash-mixed-SSSSF": (dataclasses.replace(FIVE, layer_types=(S, S, S, S, F), sliding_window=6), "dflash",
                           [(6, True)] * 4 + [(None, False)]),
    "dflash-is-causal-full": (dataclasses.replace(DRAFTER, causal=True), "dflash", [(None, True)] * 2),
    "dflash-use-swa-non-causal": (dataclasses.replace(DRAFTER, use_swa=True, sliding_window=4, causal=False),
                                  "dflash", [(4, False)] * 2),
    "dspark-native-sliding": (dataclasses.replace(DSPARK, layer_types=(S, S), sliding_window=5), "dspark",
                              [(5, True)] * 2),
    # Speculators' mask: the window counts from the block's anchor
    "dspark-speculators-sliding": (dataclasses.replace(DSPARK, layer_types=(S, S), sliding_window=5), "speculators",
                                   [(5, True, True)] * 2),
    "dspark-speculators-mixed-non-causal": (dataclasses.replace(DSPARK, layer_types=(S, F), sliding_window=5,
                                                                causal=False), "speculators",
                                            [(5, False, True), (None, False)]),
}
DFLASH2 = dataclasses.replace(DRAFTER, layer_types=(S, S), sliding_window=6, causal=False, conv_kernel_size=2,
                              conv_group_size=16, selector_rank=8, selector_top_k=6, output_multiplier=0.5,
                              final_logit_softcapping=20.0)  # z-lab's DFlash2 layout at tiny dims
BLOCK_CASES["dflash2-sliding-non-causal"] = (DFLASH2, "dflash", [(6, False)] * 2)
HEAD = Eagle3Config(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    vocab_size=512, draft_vocab_size=128, target_layer_ids=(1, 3, 5), target_hidden_size=64,
                    sliding_window=4)


@pytest.fixture(scope="module", params=list(BLOCK_CASES))
def block_case(request, tmp_path_factory):
    cfg, layout, masks = BLOCK_CASES[request.param]
    d = write_dflash_checkpoint(tmp_path_factory.mktemp(request.param), cfg, seed=5, layout=layout)
    return d, masks


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return write_eagle3_checkpoint(tmp_path_factory.mktemp("eagle3-sliding"), HEAD, seed=4)


def jitted(module, method: str, static: tuple[int, ...] = ()):
    """module.method as one jitted program of its arguments (static: the indices of those that are
    static), the module's weights an input of it: not the operation-by-operation dispatch, which
    compiles each operation at each shape it meets."""
    graphdef, weights = nnx.split(module)
    fn = jax.jit(lambda weights, *a: getattr(nnx.merge(graphdef, weights), method)(*a),
                 static_argnums=tuple(i + 1 for i in static))
    return lambda *a: fn(weights, *a)


# ----------------------------------------------------------------------------- the NumPy reference


def rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """NeoX rotate-half over the whole head: x [T, heads, d] at positions pos [T]."""
    half = x.shape[-1] // 2
    ang = pos[:, None] * theta ** -(np.arange(half) / half)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    return np.concatenate([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1)


def mask(q_pos, k_pos, window, causal):
    d = q_pos[:, None] - k_pos[None, :]
    seen = d >= 0 if causal else np.ones(d.shape, bool)
    return seen & (d < window) & (-d < window) if window else seen


def anchored_mask(c, T, window, causal):
    """Speculators' training mask: the `window` context positions before the anchor c, then the
    block (causally or not), for every query of the block."""
    context = np.broadcast_to(np.arange(c) >= c - window, (T, c))
    return np.concatenate([context, mask(np.arange(T), np.arange(T), None, causal)], axis=1)


def attention(q, k, v, visible):
    """q [T, nq, d], k / v [S, nkv, d], visible [T, S] -> [T, nq * d]."""
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, 1), np.repeat(v, g, 1)
    s = np.where(visible[None], np.einsum("tnd,snd->nts", q, k) / np.sqrt(q.shape[-1]), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("nts,snd->tnd", p / p.sum(-1, keepdims=True), v).reshape(q.shape[0], -1)


def mlp(x, w, pre):
    gate, up = x @ w[pre + "gate_proj.weight"].T, x @ w[pre + "up_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * up) @ w[pre + "down_proj.weight"].T


def heads(x, n):
    return x.reshape(x.shape[0], n, -1)


def conv(x, coef, base, group_size):
    """DFlash2's causal convolution along the block: x [T, H], coef [T, taps, G], base [taps, H]."""
    out = np.zeros_like(x)
    for o in range(base.shape[0]):
        out += (base[o] + np.repeat(coef[:, o], group_size, -1)) * np.pad(x[:len(x) - o], ((o, 0), (0, 0)))
    return out


def conv_pair(w, name, h):
    """(`prepare`'s output, `finish`'s coefficients) of conv `name`, or (h, None) without one."""
    if name + ".base_kernel" not in w:
        return h, None
    base = w[name + ".base_kernel"]
    coef = (h @ w[name + ".kernel_projection.weight"].T).reshape(len(h), 2, base.shape[1], -1)
    return conv(h, coef[:, 0], base[0], h.shape[1] // coef.shape[-1]), coef[:, 1]


def conv_finish(w, name, h, coef):
    return h if coef is None else conv(h, coef, w[name + ".base_kernel"][1], h.shape[1] // coef.shape[-1])


def block_reference(w, masks, taps, x, theta=1e6):
    """z-lab's drafter over context taps [c, n*H] (positions 0..c-1) and the embedded block x
    [T, H] (positions c..): each layer attends over [context K/V; block K/V] under its mask.
    Returns the post-norm block hidden [T, H]."""
    c, T = taps.shape[0], x.shape[0]
    ctx = rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
    pos_k, pos_q = np.arange(c + T), np.arange(c, c + T)
    for i, (window, causal, *anchored) in enumerate(masks):
        a = f"layers.{i}.self_attn."
        h, coef = conv_pair(w, f"layers.{i}.attention_conv", rms(x, w[f"layers.{i}.input_layernorm.weight"]))
        d = w[a + "q_norm.weight"].shape[0]
        nq, nkv = w[a + "q_proj.weight"].shape[0] // d, w[a + "k_proj.weight"].shape[0] // d
        q = rope(rms(heads(h @ w[a + "q_proj.weight"].T, nq), w[a + "q_norm.weight"]), pos_q, theta)
        both = np.concatenate([ctx, h])
        k = rope(rms(heads(both @ w[a + "k_proj.weight"].T, nkv), w[a + "k_norm.weight"]), pos_k, theta)
        v = heads(both @ w[a + "v_proj.weight"].T, nkv)
        seen = anchored_mask(c, T, window, causal) if anchored and anchored[0] else mask(pos_q, pos_k, window, causal)
        out = attention(q, k, v, seen) @ w[a + "o_proj.weight"].T
        x = x + conv_finish(w, f"layers.{i}.attention_conv", out, coef)
        h, coef = conv_pair(w, f"layers.{i}.mlp_conv", rms(x, w[f"layers.{i}.post_attention_layernorm.weight"]))
        x = x + conv_finish(w, f"layers.{i}.mlp_conv", mlp(h, w, f"layers.{i}.mlp."), coef)
    return rms(x, w["norm.weight"])


def selector_walk(w, hidden, lm_head, anchor, multiplier, cap, top_k):
    """z-lab's greedy `CandidateSelector.select`: hidden [k, H] post-norm block outputs 1.. ->
    the k tokens of the best-scored walk from the anchor."""
    logits = np.tanh(hidden @ lm_head.T * multiplier / cap) * cap
    prev, path = anchor, []
    for j in range(len(hidden)):
        cand = np.argsort(-logits[j])[:top_k]
        hp = hidden[j] @ w["candidate_selector.hidden_projection.weight"].T
        scores = logits[j, cand] + (w["candidate_selector.predecessor_codebook"][prev] * hp) @ \
            w["candidate_selector.successor_codebook"][cand].T
        prev = int(cand[np.argmax(scores)])
        path.append(prev)
    return path


def head_reference(w, window, embedded, hidden, theta=10000.0):
    """The EAGLE-3 midlayer (norm before residual) over rows 0..n-1: embedded [n, H] (token p+1)
    and hidden [n, H] (fc of the taps at p), causal within the window. Returns the pre-norm [n, H]."""
    n = embedded.shape[0]
    normed = rms(hidden, w["layers.0.hidden_norm.weight"])
    x = np.concatenate([rms(embedded, w["layers.0.input_layernorm.weight"]), normed], -1)
    a, pos = "layers.0.self_attn.", np.arange(n)
    q = rope(heads(x @ w[a + "q_proj.weight"].T, 4), pos, theta)
    k = rope(heads(x @ w[a + "k_proj.weight"].T, 2), pos, theta)
    v = heads(x @ w[a + "v_proj.weight"].T, 2)
    r = normed + attention(q, k, v, mask(pos, pos, window, True)) @ w[a + "o_proj.weight"].T
    return r + mlp(rms(r, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.mlp.")


# ----------------------------------------------------------------------------- DFlash / DSpark


def test_each_layout_resolves_vllms_layer_masks(block_case):
    d, masks = block_case
    _, cfg = load_dflash(d, TINY)
    assert [cfg.layer_attention(i) for i in range(cfg.num_hidden_layers)] == [LayerAttention(*m) for m in masks]


def test_bounded_cache_written_piecewise_matches_the_reference(block_case):
    """Context written a few positions at a time (the last of each write not yet committed, so
    skipped) into caches of the window's length: the block sees what the full forward sees."""
    d, masks = block_case
    draft, cfg = load_dflash(d, TINY)
    w = load_file(str(d / "model.safetensors"))
    rng = np.random.default_rng(0)
    c, T = 23, cfg.block_size
    taps, x = rng.normal(size=(c, 3 * 64)).astype(np.float32), rng.normal(size=(T, 64)).astype(np.float32)
    cache = draft.init_cache(1, 64)
    assert [run.k.shape[3] for run in cache] == [m[0] or 64 for m in dict.fromkeys(masks)]  # the window, or all
    cache = draft.write_context(cache, jnp.asarray(taps[None, :9]), jnp.asarray([0]), jnp.asarray([9]))
    for start in range(9, c, 2):  # three positions written, two of them committed
        chunk = np.pad(taps[start:start + 3], ((0, 3 - len(taps[start:start + 3])), (0, 0)))
        cache = draft.write_context(cache, jnp.asarray(chunk[None]), jnp.asarray([start]),
                                    jnp.asarray([min(2, c - start)]))
    got = draft.block(jnp.asarray(x[None]), jnp.arange(c, c + T)[None], cache, jnp.asarray([c]))[0]
    assert relative_error(got, block_reference(w, masks, taps, x)) < 1e-4
    draft.use_decode_layout()  # the GPU's layout: each layer's weights arrays of their own, run unrolled
    unrolled = draft.block(jnp.asarray(x[None]), jnp.arange(c, c + T)[None], cache, jnp.asarray([c]))[0]
    assert relative_error(unrolled, got) < 1e-6


def test_engine_state_matches_the_reference_and_greedy_equals_plain(block_case, tiny_llm, plain_greedy):
    d, masks = block_case
    cfg = json.loads((d / "config.json").read_text())
    method = "dspark" if "markov_rank" in cfg else "dflash"
    k = 4 if method == "dspark" else 3
    llm = tiny_llm.with_speculation(drafter_spec(method, d, k, **FIXED_K))
    assert_greedy_equals_plain(llm, plain_greedy)
    # In the batch bucket the greedy runs above compiled (row 0 is the prompt; the others are padding)
    state, do_sample, _ = llm.engine.start([[3, 1, 4, 1, 5, 9, 2, 6]], [GREEDY])
    state = llm.engine.decode(state, 6, do_sample)
    c = int(state.lengths[0]) - 1  # committed positions with features
    model, draft = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    out = model(state.tokens[:1, :c], Batch(jnp.zeros(1, jnp.int32), jnp.asarray([c])),
                init_cache(model.cfg, 1, c, jnp.float32), kv_len=c, taps=draft.cfg.target_layer_ids)
    x = model.embed(jnp.full((1, 4), 510, jnp.int32).at[0, 0].set(state.tokens[0, c]))
    row0 = jax.tree.map(lambda a: a[:, :1], state.proposer)  # each layer's K/V [layers, B, ...] at row 0
    got = draft.block(x, c + jnp.arange(4)[None], row0, jnp.asarray([c]))[0]
    want = block_reference(load_file(str(d / "model.safetensors")), masks, np.asarray(out.taps[0]), np.asarray(x[0]))
    assert relative_error(got, want) < 1e-4


def test_a_sliding_cache_does_not_grow_with_the_context(tmp_path):
    draft, _ = load_dflash(write_dflash_checkpoint(tmp_path / "m", BLOCK_CASES["dflash-mixed-SSSSF"][0]), TINY)
    for max_len in (64, 1 << 20):
        sliding, full = jax.eval_shape(lambda n=max_len: draft.init_cache(1, n))
        assert sliding.k.shape == (4, 1, 2, 6, 16) and full.k.shape == (1, 1, 2, max_len, 16)  # head-major
    head, _ = load_eagle3(write_eagle3_checkpoint(tmp_path / "e", HEAD), TINY)
    assert jax.eval_shape(lambda: head.init_cache(1, 1 << 20, k=3)).k.shape == (1, 1, 2, 4 + 3, 16)


@pytest.mark.parametrize("keys, causal", [
    ({"is_causal": False, "dflash_config": {"causal": True}}, False),  # is_causal first
    ({"dflash_config": {"causal": False}}, False),  # then dflash_config.causal
    ({}, True),  # then causal exactly for sliding layers
])
def test_causality_is_is_causal_then_dflash_config_then_the_layer_kind(keys, causal):
    base = {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "layer_types": [S, F], "sliding_window": 8, "use_sliding_window": True,
            "dflash_config": {"target_layer_ids": [1], "mask_token_id": 5}}
    cfg = DFlashConfig.from_hf({**base, **keys, "dflash_config": {**base["dflash_config"],
                                                                  **keys.get("dflash_config", {})}})
    assert cfg.layer_attention(0) == LayerAttention(8, causal)
    assert cfg.layer_attention(1) == LayerAttention(None, False)  # full; every override here is false


@pytest.mark.parametrize("flag, causal", [(False, True), (None, True), (True, False)])
def test_speculators_causality_is_its_sliding_window_non_causal_flag(tmp_path, flag, causal):
    d = write_dflash_checkpoint(tmp_path / "s", dataclasses.replace(DSPARK, layer_types=(S, F), sliding_window=5),
                                layout="speculators")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("sliding_window_non_causal")
    cfg.update({} if flag is None else {"sliding_window_non_causal": flag})  # absent: Speculators' default, false
    got = DFlashConfig.from_hf(cfg)
    assert [got.layer_attention(i) for i in range(2)] == [LayerAttention(5, causal, True), LayerAttention()]


@pytest.mark.parametrize("change, message", [
    ({"use_sliding_window": False}, "sliding-attention layers but no window"),
    ({"sliding_window": 0}, "sliding window 0 must be a positive integer"),
    ({"layer_types": [S, "chunked_attention"]}, "layer kind 'chunked_attention' is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"dflash_config": {"target_layer_ids": [1], "mask_token_id": 5, "attention_sink_bias": True}},
     "attention_sink_bias=True is not supported"),
])
def test_bad_sliding_configs_are_refused_by_name(change, message):
    base = {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "layer_types": [S, S], "sliding_window": 8, "use_sliding_window": True,
            "dflash_config": {"target_layer_ids": [1], "mask_token_id": 5}}
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_hf({**base, **change})


def test_dflash2_keeps_z_labs_names_and_drafts_its_selectors_walk(tiny_llm, tmp_path):
    d = write_dflash_checkpoint(tmp_path / "d2", DFLASH2, seed=6)
    w = load_file(str(d / "model.safetensors"))
    for name in ("candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                 "candidate_selector.successor_codebook", "layers.1.attention_conv.base_kernel",
                 "layers.0.attention_conv.kernel_projection.weight", "layers.1.mlp_conv.kernel_projection.weight"):
        assert name in w
    assert json.loads((d / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    llm = tiny_llm.with_speculation(drafter_spec("dflash", d, 3, **FIXED_K))
    state, do_sample, _ = llm.engine.start([[3, 1, 4, 1, 5, 9, 2, 6]], [GREEDY], rows=1)
    state = llm.engine.decode(state, 3, do_sample)
    model, draft = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    drafts, *_ = llm.engine.plan.proposer.propose(model, draft, state.proposer, state.tokens, state.lengths,
                                                  lambda logits, pos: (jnp.argmax(logits, -1).astype(jnp.int32), None))
    c = int(state.lengths[0]) - 1
    out = model(state.tokens[:, :c], Batch(jnp.zeros(1, jnp.int32), jnp.asarray([c])),
                init_cache(model.cfg, 1, c, jnp.float32), kv_len=c, taps=DFLASH2.target_layer_ids)
    x = np.asarray(model.embed(jnp.full((1, 4), 510, jnp.int32).at[0, 0].set(state.tokens[0, c]))[0])
    hidden = block_reference(w, [(6, False)] * 2, np.asarray(out.taps[0]), x)[1:]
    want = selector_walk(w, hidden, np.asarray(model.lm_head.weight[...]), int(state.tokens[0, c]), 0.5, 20.0, 6)
    assert np.asarray(drafts[0]).tolist() == want
    # sampled: each position's q is a distribution over its top-k candidates only
    _, _, q, _ = llm.engine.plan.proposer.propose(model, draft, state.proposer, state.tokens, state.lengths,
                                                  lambda logits, pos: (jnp.argmax(logits, -1).astype(jnp.int32),
                                                                       jax.nn.softmax(logits, -1)))
    q = np.asarray(q[0])
    assert np.allclose(q.sum(-1), 1.0, atol=1e-5) and ((q > 0).sum(-1) <= 6).all()
    sampled = tiny_llm.with_speculation(drafter_spec("dflash", d, 3, draft_sample_method="probabilistic", **FIXED_K))
    out = sampled.generate(prompt_token_ids=[[3, 1, 4, 1, 5]], sampling_params=SamplingParams(
        max_tokens=12, temperature=0.9, seed=1, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 12


@pytest.mark.parametrize("change, message", [
    ({"selector_rank": None}, r"dflash_config.selector_rank=None must be a positive integer"),
    ({"conv_group_size": 0}, r"dflash_config.conv_group_size=0 must be a positive integer"),
])
def test_bad_dflash2_configs_are_refused_by_name(tmp_path, change, message):
    d = write_dflash_checkpoint(tmp_path / "d2", DFLASH2)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"].update(change)
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_hf(cfg)


# ----------------------------------------------------------------------------- EAGLE-3


def test_sliding_head_resolves_and_its_ring_matches_the_reference(head_dir):
    head, cfg = load_eagle3(head_dir, TINY)
    assert cfg.sliding_window == 4
    w = load_file(str(head_dir / "model.safetensors"))
    rng = np.random.default_rng(1)
    n = 19
    emb, hid = rng.normal(size=(2, 1, n, 64)).astype(np.float32)
    cache = head.init_cache(1, 64, k=3)
    assert cache.k.shape[3] == 4 + 3
    run = jitted(head, "run", static=(4,))
    pre, cache = run(jnp.asarray(emb[:, :7]), jnp.asarray(hid[:, :7]), Batch(jnp.asarray([0]), jnp.asarray([7])),
                     cache, 64)
    outs = [pre[0]]
    for start in range(7, n, 2):  # three rows run, two committed; the third is rewritten next time
        e, h = (np.pad(a[:, start:start + 3], ((0, 0), (0, 3 - a[:, start:start + 3].shape[1]), (0, 0)))
                for a in (emb, hid))
        pre, cache = run(jnp.asarray(e), jnp.asarray(h), Batch(jnp.asarray([start]), jnp.asarray([2])), cache, 64)
        outs.append(pre[0, :2])
    got = np.concatenate(outs)[:n]
    assert relative_error(got, head_reference(w, 4, emb[0], hid[0])) < 1e-4


def test_sliding_head_engine_state_matches_the_reference_and_greedy_equals_plain(head_dir, tiny_llm, plain_greedy):
    llm = tiny_llm.with_speculation(drafter_spec("eagle3", head_dir, 3, **FIXED_K))
    assert_greedy_equals_plain(llm, plain_greedy)
    state, do_sample, _ = llm.engine.start([[3, 1, 4, 1, 5, 9, 2, 6]], [GREEDY])  # row 0 of the bucket above
    state = llm.engine.decode(state, 6, do_sample)
    n = int(state.lengths[0])
    model, head = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    seq = state.tokens[:1, :n]
    out = model(seq[:, :-1], Batch(jnp.zeros(1, jnp.int32), jnp.asarray([n - 1])),
                init_cache(model.cfg, 1, n, jnp.float32), kv_len=n - 1, taps=HEAD.target_layer_ids)
    want = head_reference(load_file(str(head_dir / "model.safetensors")), 4, np.asarray(model.embed(seq[:, 1:])[0]),
                          np.asarray(head.fc(out.taps)[0]))
    assert relative_error(state.proposer.hidden[0], want[-1]) < 1e-4


def test_norm_before_residual_defaults_to_false_as_in_vllm_and_speculators(head_dir):
    cfg = json.loads((head_dir / "config.json").read_text())
    cfg.pop("norm_before_residual")
    assert Eagle3Config.from_hf(cfg).norm_before_residual is False


def test_non_causal_head_is_refused(head_dir, tmp_path):
    cfg = json.loads((head_dir / "config.json").read_text())
    cfg["transformer_layer_config"]["is_causal"] = False
    with pytest.raises(ValueError, match="is_causal false is not supported"):
        Eagle3Config.from_hf(cfg)
