"""The shipped trained default model (`spec_jax/assets/default/`, trained on the H200 by
`python -m spec_jax.training.train`): its training log, greedy output unchanged by every drafter
it ships with, MTP acceptance above the floor training reached, the drafters' training objectives
scoring what their proposers draft, and the random fallback."""

import json

import pytest
from helpers import FIXED_K, FIXTURES

from spec_jax import LLM, SamplingParams, default_model

HELDOUT_CODE = FIXTURES / "heldout_code.json"
# Held-out code agreement of the MTP head at the step training kept (training_log.json: 0.783),
# rounded down to the floor the issue set; the fixed snippet below (a stdlib test file, in the
# current corpus's training split) measured 1.00 on CPU in float32 when the model shipped.
MTP_ACCEPTANCE_FLOOR = 0.70


@pytest.fixture(scope="module")
def trained_dir():
    assert default_model.is_trained_default(), f"the trained default model is missing from {default_model.ASSETS}"
    return default_model.ASSETS


def test_training_lowers_the_heldout_loss(trained_dir):
    log = json.loads((trained_dir / "training_log.json").read_text())
    target = [e["loss"] for e in log["target"]["evals"]]
    assert log["target"]["best"]["loss"] < target[0] - 0.2, target  # from the untrained model's ~log(vocab)
    draft = [e["loss"] for e in log["draft"]["evals"]]
    assert log["draft"]["best"]["loss"] < draft[0], draft
    assert log["dflash"]["best"]["accept_len"] >= 1.0
    assert log["eagle3"]["best"]["accept_len"] > log["eagle3"]["evals"][0]["accept_len"]


def test_every_trained_drafter_keeps_greedy_output_exact(trained_dir):
    llm = LLM(model=str(trained_dir), dtype="float32", max_model_len=128, max_num_seqs=2)
    assert llm.model.mtp is not None and llm.tokenizer is not None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["def fibonacci(n):", "The quick brown fox"]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    block = json.loads((trained_dir / "dflash" / "config.json").read_text())["dflash_config"]["block_size"]
    for spec in ({"method": "mtp", "num_speculative_tokens": 2},
                 {"method": "dflash", "model": str(trained_dir / "dflash"), "num_speculative_tokens": block - 1},
                 {"method": "eagle3", "model": str(trained_dir / "eagle3"), "num_speculative_tokens": 3},
                 {"method": "draft_model", "model": str(trained_dir / "draft"), "num_speculative_tokens": 3}):
        spec_llm = llm.with_speculation({**spec, **FIXED_K})
        outs = spec_llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == reference, spec
        assert spec_llm.metrics["num_drafts"] > 0


def test_mtp_acceptance_on_heldout_code_stays_above_the_training_floor(trained_dir):
    log = json.loads((trained_dir / "training_log.json").read_text())
    assert log["target"]["best"]["code_mtp_agree"] >= MTP_ACCEPTANCE_FLOOR
    prompt = json.loads(HELDOUT_CODE.read_text())["prompt_ids"]
    llm = LLM(model=str(trained_dir), dtype="float32", max_model_len=256, max_num_seqs=1,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1, **FIXED_K})
    llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=48, temperature=0.0))
    assert llm.metrics["acceptance_rate"] >= MTP_ACCEPTANCE_FLOOR, llm.metrics


def test_random_fallback_without_shipped_assets(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "ASSETS", tmp_path / "absent")
    monkeypatch.setenv("SPEC_JAX_HOME", str(tmp_path))
    assert not default_model.is_trained_default()
    assert default_model.default_model_dir() == tmp_path / default_model.NAME
    assert (tmp_path / default_model.NAME / "tokenizer.json").exists()


def inference_drafts(trained_dir, method: str, k: int):
    """The shipped `method` drafter's first greedy drafts on the held-out prompt, as the engine's
    proposer makes them: (llm, target model, drafts [1, k], P = prompt length, the prompt, the first
    generated token and the drafts as one sequence [1, P + 1 + k])."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from spec_jax.engine.step import drafting_policy

    prompt = json.loads(HELDOUT_CODE.read_text())["prompt_ids"]
    llm = LLM(model=str(trained_dir), dtype="float32", max_model_len=256, max_num_seqs=1,
              speculative_config={"method": method, "model": str(trained_dir / method), "num_speculative_tokens": k})
    state = llm.prefill([prompt], SamplingParams(max_tokens=8, temperature=0.0))
    model, draft = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    choose = drafting_policy(state.sampling, probabilistic=False, do_sample=False)
    propose = jax.jit(lambda *a: llm.engine.plan.proposer.propose(*a, choose)[0])  # whole, as the step runs it
    drafts = propose(model, draft, state.proposer, state.tokens, state.lengths)
    P = len(prompt)
    return llm, model, drafts, P, jnp.concatenate([state.tokens[:1, :P + 1], drafts[:1]], axis=1)


def test_dflash_training_objective_scores_the_block_inference_drafts(trained_dir):
    """The distillation loss looks at an anchor exactly as the proposer drafts there: feeding the
    proposer's first block back as labels, the training pass accepts all seven drafts."""
    import jax
    import jax.numpy as jnp

    from spec_jax.loading.drafters import load_dflash
    from spec_jax.training.losses import dflash_loss

    llm, model, drafts, P, seqs = inference_drafts(trained_dir, "dflash", 7)  # the anchor: first generated at P
    _, metrics = jax.jit(dflash_loss)(load_dflash(trained_dir / "dflash", llm.cfg, jnp.float32)[0], model, seqs,
                                      jnp.asarray([[P]]), gamma=4.0)
    assert float(metrics["accept_len"]) == 8.0, (drafts, metrics)


def test_eagle3_training_objective_scores_the_chain_inference_drafts(trained_dir):
    """Training-time test runs the head as the chained proposer does: fed the proposer's three
    drafts, training step j's argmax at the row that drafts token P+1+j is draft j."""
    import jax
    import jax.numpy as jnp

    from spec_jax.loading.drafters import load_eagle3
    from spec_jax.training.losses import eagle3_steps

    llm, model, drafts, P, seqs = inference_drafts(trained_dir, "eagle3", 3)  # row P-1 drafts position P+1
    head = load_eagle3(trained_dir / "eagle3", llm.cfg, jnp.float32)[0]
    outs = jax.jit(eagle3_steps, static_argnums=3)(head, model, seqs, 3)
    target_ids = jnp.arange(head.cfg.draft_vocab_size) + head.d2t[...]
    trained = [int(target_ids[jnp.argmax(head.lm_head(head.norm(outs[j, 0, P - 1 + j])))]) for j in range(3)]
    assert trained == drafts[0].tolist()
