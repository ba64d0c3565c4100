"""The MTP head, loaded from `mtp.*`, against HF's own decoder-layer modules fed the same weights."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HF_FIXTURES
from models.qwen3_5 import Batch, init_cache, init_mtp_cache
from spec_jax.checkpoint import load_model


def mtp_logits(model, ids: np.ndarray) -> np.ndarray:
    """Draft row p: token ids[p+1] at position p with the target's post-norm hidden at p."""
    T = len(ids)
    tokens = jnp.asarray(ids, jnp.int32)[None]
    hidden, _ = model(tokens, Batch(jnp.zeros(1, jnp.int32), jnp.asarray([T])),
                      init_cache(model.cfg, 1, T, jnp.float32), kv_len=T)
    h, _ = model.mtp(model.embed(tokens[:, 1:]), hidden[:, :-1], Batch(jnp.zeros(1, jnp.int32), jnp.asarray([T - 1])),
                     init_mtp_cache(model.cfg, 1, T, jnp.float32), kv_len=T - 1)
    return np.asarray(model.logits(h)[0])


@pytest.mark.parametrize("case", ["dense_vl", "dense_text", "moe_vl", "moe_text"])
def test_mtp_head_matches_hf_modules(case):
    ref = np.load(HF_FIXTURES / case / "reference.npz")
    model, cfg = load_model(HF_FIXTURES / case, "float32")
    assert cfg.mtp_num_hidden_layers == 1 and model.mtp is not None
    got = mtp_logits(model, ref["input_ids"])
    want = ref["mtp_logits"]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4


def test_checkpoint_without_mtp_loads_without_head():
    model, cfg = load_model(HF_FIXTURES / "next", "float32")
    assert model.mtp is None and cfg.mtp_num_hidden_layers == 0
