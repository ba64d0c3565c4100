"""The plain Qwen3 model (`models/qwen3.py`) and its loader (`spec_jax/loading/qwen3.py`).

Parity is against HF transformers 5.17 on tiny random checkpoints it wrote itself
(tests/fixtures/make_qwen3_fixture.py): `qwen3/` untied without biases, `qwen3/tied_bias/` tied
with q/k/v/o biases. CI needs no torch.
"""

import functools
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from helpers import FIXTURES, relative_error

from models.layers import Batch, KVCache
from models.qwen3 import Qwen3Config, init_qwen3_cache
from spec_jax.loading.qwen3 import load_qwen3
from spec_jax.loading.source import CheckpointError

FIXTURE = FIXTURES / "qwen3"
VARIANTS = {"untied": FIXTURE, "tied_bias": FIXTURE / "tied_bias"}


@functools.cache
def loaded(variant: str, dtype: str = "float32"):
    """(model, cfg, reference arrays) for one fixture, loaded once per session."""
    model, cfg = load_qwen3(VARIANTS[variant], dtype)
    return model, cfg, np.load(VARIANTS[variant] / "reference.npz")


def runner(model):
    """A jitted `step(tokens [B, T], start [B], n_valid [B], cache, kv_len) -> (logits
    [B, T, V], cache)` over the model's split state, as the engine drives it."""
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, static_argnames="kv_len")
    def step(params, tokens, start, n_valid, cache, kv_len):
        m = nnx.merge(graphdef, params)
        out = m(tokens, Batch(start, n_valid), cache, kv_len=kv_len)
        return m.logits(out.hidden), out.cache

    return functools.partial(step, params)


def full_logits(model, cfg, ids: np.ndarray) -> np.ndarray:
    """One uncached forward over a single row: ids [T] -> logits [T, V]."""
    T = len(ids)
    cache = init_qwen3_cache(cfg, 1, T, model.dtype)
    logits, _ = runner(model)(jnp.asarray(ids, jnp.int32)[None], jnp.zeros(1, jnp.int32),
                              jnp.full(1, T, jnp.int32), cache, kv_len=T)
    return np.asarray(logits[0])


# ----------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_hf(variant):
    model, cfg, ref = loaded(variant)
    got = full_logits(model, cfg, ref["input_ids"])
    assert got.shape == ref["logits"].shape == (32, cfg.vocab_size)
    assert got.dtype == np.float32
    assert relative_error(got, ref["logits"]) < 1e-4


def test_greedy_matches_hf_generate():
    model, cfg, ref = loaded("untied")
    graphdef, params = nnx.split(model)
    prompt, n_new = jnp.asarray(ref["prompt_ids"], jnp.int32)[None], len(ref["greedy_ids"])
    P, L = prompt.shape[1], prompt.shape[1] + n_new

    @jax.jit
    def generate(params, prompt):
        m = nnx.merge(graphdef, params)
        one = jnp.ones(1, jnp.int32)
        out = m(prompt, Batch(jnp.zeros(1, jnp.int32), P * one), init_qwen3_cache(cfg, 1, L, m.dtype), kv_len=P)
        hidden, cache = out.hidden, out.cache
        first = jnp.argmax(m.logits(hidden[:, -1]), -1).astype(jnp.int32)  # [1]

        def decode(carry, pos):
            token, cache = carry  # feed the newest token at position pos
            out = m(token[:, None], Batch(pos * one, one), cache, kv_len=L)
            nxt = jnp.argmax(m.logits(out.hidden[:, 0]), -1).astype(jnp.int32)
            cache = out.cache
            return (nxt, cache), token

        (last, _), tokens = jax.lax.scan(decode, (first, cache), P + jnp.arange(n_new - 1))
        return jnp.concatenate([tokens[:, 0], last])

    assert np.asarray(generate(params, prompt)).tolist() == ref["greedy_ids"].tolist()


# ----------------------------------------------------------------------------- caching


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_then_decode_equals_full_forward(variant):
    """Two rows of different prompt lengths (row 1 padded), then single-token steps at each row's
    own position: every step's logits equal one full uncached forward over the row."""
    model, cfg, ref = loaded(variant)
    ids = ref["input_ids"]
    n, m, L = 6, 5, 16
    lengths = np.array([n, n - 2])  # row 1's last two prefill tokens are padding
    rows = [ids[:n + m], ids[7:7 + n - 2 + m]]
    step = runner(model)
    prefill = np.stack([rows[0][:n], np.concatenate([rows[1][:n - 2], [0, 0]])])
    cache = init_qwen3_cache(cfg, 2, L, model.dtype)
    logits, cache = step(jnp.asarray(prefill, jnp.int32), jnp.zeros(2, jnp.int32), jnp.asarray(lengths, jnp.int32),
                         cache, kv_len=n)
    got = [[np.asarray(logits[r, : lengths[r]])] for r in range(2)]
    for s in range(m):
        tokens = np.array([[rows[r][lengths[r] + s]] for r in range(2)])
        logits, cache = step(jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths + s, jnp.int32),
                             jnp.ones(2, jnp.int32), cache, kv_len=L)
        for r in range(2):
            got[r].append(np.asarray(logits[r]))
    for r in range(2):
        want = full_logits(model, cfg, rows[r])
        assert relative_error(np.concatenate(got[r]), want) < 1e-5


def test_verify_pass_convention_matches_qwen3_5():
    """rollback is accepted and ignored (no pending), and commit is the identity."""
    model, cfg, ref = loaded("untied")
    tokens = jnp.asarray(ref["input_ids"][:4], jnp.int32)[None]
    batch = Batch(jnp.zeros(1, jnp.int32), jnp.full(1, 4, jnp.int32))
    cache = init_qwen3_cache(cfg, 1, 8, jnp.float32)
    plain = model(tokens, batch, cache, kv_len=4)
    out = model(tokens, batch, cache, kv_len=4, rollback="replay")
    assert out.pending is None
    np.testing.assert_array_equal(out.hidden, plain.hidden)
    assert model.commit(out.cache, out.pending, jnp.array([2])) is out.cache
    np.testing.assert_array_equal(out.cache.k, plain.cache.k)


def test_cache_shape_and_dtype():
    model, cfg, _ = loaded("untied")
    cache = init_qwen3_cache(cfg, 3, 20, jnp.bfloat16)
    assert isinstance(cache, KVCache)
    assert cache.k.shape == cache.v.shape == (4, 3, 20, 2, 32)
    assert cache.k.dtype == jnp.bfloat16
    own = model.init_cache(2, 10)  # the method the engine calls, in the model's dtype
    assert own.k.shape == (4, 2, 10, 2, 32) and own.k.dtype == model.dtype


def test_bfloat16_weights_track_float32():
    model, cfg, ref = loaded("untied", "bfloat16")
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    assert model.layers[0].input_layernorm.weight[...].dtype == jnp.float32  # norms stay float32
    assert relative_error(full_logits(model, cfg, ref["input_ids"]), ref["logits"]) < 5e-2


# ----------------------------------------------------------------------------- loading errors


def edited_copy(tmp_path: Path, edit) -> Path:
    """The untied fixture copied to tmp_path with its tensors dict passed through `edit`."""
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d, ignore=shutil.ignore_patterns("tied_bias", "reference.npz"))
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("name", ["model.layers.2.mlp.up_proj.weight", "lm_head.weight", "model.norm.weight"])
def test_missing_tensor_is_named(tmp_path, name):
    d = edited_copy(tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"checkpoint is missing tensor '{name}'"):
        load_qwen3(d)


def test_wrong_shape_is_named(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    d = edited_copy(tmp_path, lambda t: t.update({name: t[name][:, :32]}))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \(64, 32\), expected \(64, 64\)"):
        load_qwen3(d)


# ----------------------------------------------------------------------------- config


def test_config_from_fixture():
    _, cfg, _ = loaded("untied")
    assert (cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads, cfg.rope_theta) == (4, 32, 2, 10000.0)
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and cfg.eos_token_id == (511,)
    model, tied, _ = loaded("tied_bias")
    assert tied.tie_word_embeddings and tied.attention_bias and model.lm_head is None


def test_config_transformers4_layout():
    """Released Qwen3 config.json files: top-level rope_theta, rope_scaling null, no rope_parameters."""
    cfg = Qwen3Config.from_hf({"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16,
                               "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 28,
                               "rope_theta": 1000000, "rope_scaling": None, "use_sliding_window": False,
                               "sliding_window": None, "max_window_layers": 28, "eos_token_id": 151645,
                               "tie_word_embeddings": True, "torch_dtype": "bfloat16"})
    assert cfg.rope_theta == 1000000 and cfg.head_dim == 128 and cfg.rotary_dim == 128
    assert cfg.eos_token_id == (151645,) and cfg.tie_word_embeddings
    assert cfg.pattern == ("full_attention",) and cfg.num_groups == 28


@pytest.mark.parametrize("raw, match", [
    ({"model_type": "llama"}, "model_type 'llama'"),
    ({"model_type": "qwen3", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"model_type": "qwen3", "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}, "rope_type 'linear'"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"], "num_hidden_layers": 2},
     "'sliding_attention'"),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1,
      "num_hidden_layers": 2}, "'sliding_attention'"),
    ({"model_type": "qwen3", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_unsupported_configs_are_refused(raw, match):
    with pytest.raises(ValueError, match=match):
        Qwen3Config.from_hf(raw)


def test_llama_checkpoint_dir_is_refused(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        load_qwen3(d)
