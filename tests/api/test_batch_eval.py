"""`spec-jax bench`: a JSONL of prompts through the jitted engine; its outputs and metrics equal
a direct LLM.generate run's; bad lines are named."""

import json

import numpy as np
import pytest

from spec_jax import LLM, SamplingParams
from spec_jax.api.batch_eval import read_requests
from spec_jax.api.cli import main

# At a fixed k, so that the draft counts of two runs compare: adaptive verification chooses from
# step times each engine measures.
SPEC = {"method": "mtp", "num_speculative_tokens": 3, "enable_adaptive_verification": False}


def lines(seed=0):
    """Eight greedy requests of varied length and budget."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(8):
        line = {"id": f"r{i}", "prompt_token_ids": rng.integers(0, 60, rng.integers(2, 50)).tolist()}
        if i % 2:
            line["max_tokens"] = int(rng.integers(3, 40))
        out.append(line)
    return out


def test_metrics_and_outputs_equal_a_direct_run(echo_dir, tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines()) + "\n\n")
    rc = main(["bench", "--model", str(echo_dir), "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
               "--speculative-config", json.dumps(SPEC), "--input", str(src), "--max-tokens", "24"])
    assert rc == 0
    outputs = [json.loads(x) for x in (tmp_path / "prompts.outputs.jsonl").read_text().splitlines()]
    metrics = json.loads((tmp_path / "prompts.metrics.json").read_text())

    llm = LLM(model=str(echo_dir), dtype="float32", max_model_len=128, max_num_seqs=4, speculative_config=SPEC)
    params = [SamplingParams(max_tokens=x.get("max_tokens", 24), temperature=0.0) for x in lines()]
    ref = llm.generate(prompt_token_ids=[x["prompt_token_ids"] for x in lines()], sampling_params=params,
                       use_tqdm=False)
    per_request = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_per_position")
    for line, got, want in zip(lines(), outputs, ref):
        assert (got["id"], got["prompt_token_ids"]) == (line["id"], line["prompt_token_ids"])
        assert (got["token_ids"], got["finish_reason"]) == (want.outputs[0].token_ids, want.outputs[0].finish_reason)
        assert {k: got["metrics"][k] for k in per_request} == {k: want.metrics[k] for k in per_request}
    for k in ("num_requests", "num_generated_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert metrics[k] == llm.metrics[k]
    assert metrics["num_accepted_tokens"] > 0
    for k in ("acceptance_rate", "mean_acceptance_length", "acceptance_per_position"):
        assert metrics[k] == pytest.approx(llm.metrics[k])
    assert metrics["num_prompt_tokens"] == sum(len(x["prompt_token_ids"]) for x in lines())
    assert metrics["tokens_per_s"] > 0 and metrics["speculative_config"]["method"] == "mtp"


BAD_LINES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"prompt_token_ids": [1], "temprature": 0}', "unknown key 'temprature'"),
    ('{"prompt_token_ids": [1], "prompt": "a"}', "exactly one of"),
    ('{"max_tokens": 3}', "exactly one of"),
    ('{"prompt_token_ids": 5}', "must be a list"),
    ('{"prompt_token_ids": [1, 99999]}', "outside the vocabulary"),
    ('{"prompt_token_ids": []}', "empty"),
    ('{"prompt_token_ids": [1], "temperature": -1}', "temperature"),
    ('{"prompt": "text"}', "no tokenizer.json"),
]


@pytest.mark.parametrize("bad,message", BAD_LINES)
def test_a_bad_line_is_named(tiny_llm, tmp_path, bad, message):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt_token_ids": [1, 2]}\n\n' + bad + "\n")
    with pytest.raises(ValueError, match=f"line 3: .*{message}"):
        read_requests(tiny_llm, src, max_tokens=8, temperature=0.0)


def test_per_line_settings_override_the_defaults(tiny_llm, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt_token_ids": [1]}\n{"prompt_token_ids": [2], "max_tokens": 3, "temperature": 0.5, '
                   '"top_p": 0.9, "top_k": 7, "seed": 11, "ignore_eos": true, "id": 5, "stop": ["\\n\\n", "x"], '
                   '"stop_token_ids": [4]}\n')
    a, b = read_requests(tiny_llm, src, max_tokens=8, temperature=0.0)
    assert (a.params.max_tokens, a.params.temperature, a.params.stop, a.id) == (8, 0.0, None, None)
    assert (b.params.max_tokens, b.params.temperature, b.params.top_p, b.params.top_k, b.params.seed,
            b.params.ignore_eos, b.params.stop, b.params.stop_token_ids, b.id, b.line) == (
        3, 0.5, 0.9, 7, 11, True, ["\n\n", "x"], [4], 5, 2)


def test_an_empty_file_is_refused(tiny_llm, tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_requests(tiny_llm, tmp_path / "e.jsonl", max_tokens=8, temperature=0.0)


def test_a_missing_input_file_is_an_error_not_a_traceback(tiny_dir, tmp_path, capsys):
    rc = main(["bench", "--model", str(tiny_dir), "--input", str(tmp_path / "absent.jsonl")])
    assert rc == 2
    assert f"error: No such file or directory: '{tmp_path / 'absent.jsonl'}'" in capsys.readouterr().err


def test_an_input_that_is_not_utf8_is_named(tiny_llm, tmp_path):
    (tmp_path / "b.jsonl").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"b.jsonl is not UTF-8 text"):
        read_requests(tiny_llm, tmp_path / "b.jsonl", max_tokens=8, temperature=0.0)


def test_an_output_directory_that_does_not_exist_is_refused_before_generating(tiny_llm, tmp_path, monkeypatch):
    import spec_jax.api.batch_eval as batch_eval

    (tmp_path / "p.jsonl").write_text('{"prompt_token_ids": [1, 2]}\n')
    monkeypatch.setattr(batch_eval, "run", lambda *a, **k: pytest.fail("generated before checking the output path"))
    with pytest.raises(ValueError, match="its directory .*nowhere does not exist"):
        batch_eval.run_file(tiny_llm, str(tmp_path / "p.jsonl"), str(tmp_path / "nowhere" / "o.jsonl"))
