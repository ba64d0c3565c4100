"""vLLM's own offline examples (tests/api/vllm_examples/, Apache-2.0 copies) run on the embedded
default model with only their imports and model changed: every changed line says what it was."""

import re
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent / "vllm_examples"


@pytest.mark.parametrize("name", ["generate.py", "chat.py", "utils.py", "prefix_caching.py", "spec_decode.py"])
def test_only_imports_and_the_model_changed(name):
    lines = (EXAMPLES / name).read_text().splitlines()
    assert lines[0] == "# SPDX-License-Identifier: Apache-2.0" and "Apache License 2.0" in "\n".join(lines[1:4])
    changed = [line for line in lines[4:] if "# was: " in line]
    assert changed and all(re.search(r"\bspec_jax\b|model=None|default_model_dir\(\)", line) for line in changed)
    # an import from vllm, or code naming its modules (not its "vllm:" metric names or asset URLs)
    unmarked = [line for line in lines[4:] if re.search(r"\bspec_jax\b|\bvllm\.|\b(from|import) vllm\b", line)
                and "# was: " not in line]
    assert unmarked == []


def run_example(name: str, argv: list[str], monkeypatch, capsys) -> str:
    """Run an example as its own __main__ with these command-line flags; returns what it printed."""
    monkeypatch.setattr(sys, "argv", [name, *argv])
    monkeypatch.syspath_prepend(str(EXAMPLES))  # chat.py imports its neighbour utils.py
    monkeypatch.delitem(sys.modules, "utils", raising=False)
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


def test_generate_builds_its_llm_from_vllms_engine_flags(monkeypatch, capsys):
    out = run_example("generate.py", ["--max-tokens", "8", "--max_model_len", "128", "--temperature", "0",
                                      "--enforce-eager", "-tp", "1"], monkeypatch, capsys)
    printed = re.findall(r"Prompt: '([^']*)', Generated text: '", out)
    assert printed == ["Hello, my name is", "The president of the United States is", "The capital of France is",
                       "The future of AI is"]


def test_chat_runs_one_conversation_then_a_batch_of_ten(monkeypatch, capsys):
    out = run_example("chat.py", ["--max-tokens", "8", "--max-model-len", "256"], monkeypatch, capsys)
    assert out.count("Generated text: ") == 11
    assert out.count("Prompt: '<|im_start|>system\\nYou are a helpful assistant<|im_end|>") == 11


def test_prefix_caching_gives_the_same_answers(monkeypatch, capsys):
    out = run_example("prefix_caching.py", [], monkeypatch, capsys)
    assert out.count("Generated text: ") == 8
    assert out.rstrip().endswith("Generated answers are the same: True")


SPEC_DECODE_FLAGS = ["--num-prompts", "2", "--random-input-len", "16", "--output-len", "8", "--max-model-len", "64",
                     "--max-num-seqs", "2", "--print-output"]


def test_spec_decode_runs_mtp_on_random_prompts_and_reads_the_metrics(monkeypatch, capsys):
    out = run_example("spec_decode.py", ["--method", "mtp", *SPEC_DECODE_FLAGS], monkeypatch, capsys)
    assert out.count("generated text: ") == 2
    stat = {k: int(v) for k, v in re.findall(r"^(total_num_output_tokens|num_drafts|num_draft_tokens|"
                                             r"num_accepted_tokens): (\d+)$", out, re.M)}
    assert 0 < stat["total_num_output_tokens"] <= 16 and stat["num_drafts"] > 0
    assert stat["num_accepted_tokens"] <= stat["num_draft_tokens"] <= 2 * stat["num_drafts"]
    length = float(re.search(r"mean acceptance length: ([\d.]+)", out).group(1))
    assert length == pytest.approx(1 + stat["num_accepted_tokens"] / stat["num_drafts"], abs=0.005)
    rates = [float(r) for r in re.findall(r"^acceptance at token (?:0|1): ([\d.]+)$", out, re.M)]
    assert len(rates) == 2 and rates[0] >= rates[1]


def test_spec_decode_default_method_eagle_is_refused_naming_eagle3(monkeypatch, capsys):
    with pytest.raises(ValueError, match="eagle3"):
        run_example("spec_decode.py", SPEC_DECODE_FLAGS, monkeypatch, capsys)
