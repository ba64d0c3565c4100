"""The trained default model: the shipped one when `spec_jax/assets/default/` holds it, else a
tiny CPU run of the whole training pipeline (corpus -> BPE -> target + MTP -> DFlash -> draft
model -> export), loaded through the public API with every drafter it trains."""

import json

import pytest

from spec_jax import LLM, SamplingParams
from spec_jax import default_model
from spec_jax.training import train
from spec_jax.training.corpus import build_corpus


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    if default_model.is_trained_default():
        return default_model.ASSETS
    tmp = tmp_path_factory.mktemp("trained")
    build_corpus(tmp / "corpus.npz", vocab_size=384, limit_chars=60_000)
    train.main(["--out", str(tmp / "out"), "--corpus", str(tmp / "corpus.npz"), "--tiny", "--max-steps", "24",
                "--eval-every", "1000", "--dflash-sequences", "8", "--eval-windows", "2", "--lr-target", "1e-2"])
    return tmp / "out"


def test_training_lowers_the_heldout_loss(trained_dir):
    log = json.loads((trained_dir / "training_log.json").read_text())
    target = [e["loss"] for e in log["target"]["evals"]]
    assert log["target"]["best"]["loss"] < target[0] - 0.2, target  # from the untrained model's ~log(vocab)
    draft = [e["loss"] for e in log["draft"]["evals"]]
    assert log["draft"]["best"]["loss"] < draft[0], draft
    assert log["dflash"]["best"]["accept_len"] >= 1.0


def test_every_trained_drafter_keeps_greedy_output_exact(trained_dir):
    llm = LLM(model=str(trained_dir), dtype="float32", max_model_len=128, max_num_seqs=2)
    assert llm.model.mtp is not None and llm.tokenizer is not None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["def fibonacci(n):", "The quick brown fox"]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    block = json.loads((trained_dir / "dflash" / "config.json").read_text())["dflash_config"]["block_size"]
    for spec in ({"method": "mtp", "num_speculative_tokens": 2},
                 {"method": "dflash", "model": str(trained_dir / "dflash"), "num_speculative_tokens": block - 1},
                 {"method": "draft_model", "model": str(trained_dir / "draft"), "num_speculative_tokens": 3}):
        spec_llm = llm.with_speculation(spec)
        outs = spec_llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == reference, spec
        assert spec_llm.metrics["num_drafts"] > 0


def test_random_fallback_without_shipped_assets(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "ASSETS", tmp_path / "absent")
    monkeypatch.setenv("SPEC_JAX_HOME", str(tmp_path))
    assert not default_model.is_trained_default()
    assert default_model.default_model_dir() == tmp_path / default_model.NAME
    assert (tmp_path / default_model.NAME / "tokenizer.json").exists()
