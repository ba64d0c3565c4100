"""EAGLE-3 in the Speculators layout: greedy output equals plain decoding (shared or own
embedding, reduced vocabulary through d2t, `midlayer.*` names), the head's state follows the
accepted prefix, and heads that do not fit the target are refused by name."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DRAFT_GREEDY as GREEDY
from helpers import assert_greedy_equals_plain, drafter_spec
from helpers import drafter_prompts as prompts
from flax import nnx
from safetensors.numpy import load_file

from models.eagle3 import Eagle3Config
from models.layers import Batch
from models.qwen3_5 import init_cache
from spec_jax.writing.random_checkpoint import write_eagle3_checkpoint

HEAD = Eagle3Config(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    vocab_size=512, draft_vocab_size=128, target_layer_ids=(1, 3, 5), target_hidden_size=64)


def spec(d, k=3):
    return drafter_spec("eagle3", d, k)


@pytest.mark.parametrize("head, midlayer", [(HEAD, False),
                                            (dataclasses.replace(HEAD, hidden_size=48, has_embedding=True), True)],
                         ids=["shared-embedding", "own-embedding-midlayer-names"])
def test_greedy_equals_plain_alone_and_in_a_mixed_batch(tiny_llm, plain_greedy, tmp_path, head, midlayer):
    d = write_eagle3_checkpoint(tmp_path / "e", head, seed=2, midlayer_names=midlayer)
    llm = tiny_llm.with_speculation(spec(d))
    assert_greedy_equals_plain(llm, plain_greedy)
    assert llm.metrics["num_draft_tokens"] > 0


def test_drafts_stay_in_the_draft_vocabulary_and_state_follows_the_prefix(tiny_llm, tmp_path):
    d = write_eagle3_checkpoint(tmp_path / "e", HEAD, seed=3)
    allowed = set((np.arange(128) + load_file(str(d / "model.safetensors"))["d2t"]).tolist())
    llm = tiny_llm.with_speculation(spec(d))
    state, do_sample, _ = llm.engine.start(prompts()[1:2], [GREEDY])  # row 0 of the batch bucket is read below
    state = llm.engine.decode(state, 4, do_sample)
    model, head = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    next_draft = int(jnp.argmax(llm.engine.plan.proposer.next_logits(model, head, state.proposer)[0]))
    assert next_draft in allowed
    # a fresh pass of the head over the whole committed sequence drafts the same next token
    n = int(state.lengths[0])
    seq = state.tokens[:1, :n]
    out = model(seq[:, :-1], Batch(jnp.zeros(1, jnp.int32), jnp.asarray([n - 1])),
                init_cache(model.cfg, 1, n, jnp.float32), kv_len=n - 1, taps=HEAD.target_layer_ids)
    logits, pre, _ = head(head.embed(seq[:, 1:], model.embed), head.fc(out.taps),
                          Batch(jnp.zeros(1, jnp.int32), jnp.asarray([n - 1])), head.init_cache(1, n), n - 1)
    assert int(jnp.argmax(logits[0, -1])) == next_draft
    np.testing.assert_allclose(state.proposer.hidden[0], pre[0, -1], rtol=1e-4, atol=1e-4)


def test_default_taps_follow_vllm(tmp_path):
    cfg = dataclasses.replace(HEAD, target_layer_ids=()).with_target(36, 64)
    assert cfg.target_layer_ids == (1, 17, 32)  # vLLM's (2, L/2, L-3), counted as entering layers


@pytest.mark.parametrize("change, message", [
    (dict(vocab_size=256, draft_vocab_size=128), "vocab_size 256 but the target has 512"),
    (dict(target_hidden_size=32), "target_hidden_size 32 but the target has 64"),
    (dict(hidden_size=48), "no embed_tokens of its own"),
    (dict(target_layer_ids=(1, 3, 9)), r"taps target layers \[1, 3, 9\]"),
])
def test_heads_that_do_not_fit_are_refused(tiny_llm, tmp_path, change, message):
    d = write_eagle3_checkpoint(tmp_path / "bad", dataclasses.replace(HEAD, **change))
    with pytest.raises(ValueError, match=message):
        tiny_llm.with_speculation(spec(d))


def test_a_non_eagle3_config_is_refused(tiny_llm, tmp_path):
    d = write_eagle3_checkpoint(tmp_path / "e", HEAD)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "speculators_model_type": "medusa"}))
    with pytest.raises(ValueError, match="expected 'eagle3'"):
        tiny_llm.with_speculation(spec(d))
