"""On the GPU the engine runs the target in its decode layout (every layer's weights arrays of their
own, layers unrolled) and other models' layer scans unrolled; forced on here, the unstacked target,
its MTP head and the speculative step reproduce the rolled model's greedy output."""

from conftest import assert_greedy_equals_plain

from models import qwen3_5
from spec_jax import LLM, engine


def test_unrolled_layers_reproduce_the_rolled_model(monkeypatch, tiny_dir, plain_greedy):
    monkeypatch.setattr(qwen3_5, "unroll_layers", lambda: True)
    monkeypatch.setattr(engine, "unroll_layers", lambda: True)
    calls = []
    rolled_scan = qwen3_5.jax.lax.scan
    monkeypatch.setattr(qwen3_5.jax.lax, "scan", lambda *a, **kw: calls.append(kw.get("unroll")) or rolled_scan(*a, **kw))
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert llm.model.layers is None and len(llm.model.groups) == llm.cfg.num_groups  # the decode layout
    assert llm.model.mtp.layer is not None
    assert_greedy_equals_plain(llm, plain_greedy)
