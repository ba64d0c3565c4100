"""vLLM's offline structured-outputs example (tests/api/vllm_structured_outputs.py: only its imports
and model changed) runs on the default model, and each output obeys its constraint."""

import re
from pathlib import Path

import llguidance
import vllm_structured_outputs as example

from spec_jax import default_model
from spec_jax.engine.structured import grammar_text

SQL = r"SELECT col_[12]  from table_[12]  where col_[12] = [12] "  # each column and table ends in a space


def test_the_example_runs_with_only_its_imports_and_model_changed(capsys):
    source = Path(example.__file__).read_text().splitlines()
    assert [line for line in source if "spec_jax" in line] == [
        line for line in source if line.startswith("from spec_jax") or "spec_jax's embedded default" in line]
    example.main()
    printed = capsys.readouterr().out
    outputs = dict(re.findall(r"-{50}\n(Structured outputs by \w+): (.*?)\n-{50}", printed, re.S))
    assert outputs["Structured outputs by Choice"] in ("Positive", "Negative")
    assert re.fullmatch(SQL, outputs["Structured outputs by Grammar"])
    # The regex and the JSON may end at max_tokens (50): all of each is then a prefix its grammar allows.
    for name, params in (("Regex", example.structured_outputs_params_regex),
                         ("JSON", example.structured_outputs_params_json)):
        assert allowed_prefix(params, outputs[f"Structured outputs by {name}"]), name


def allowed_prefix(params, text: str) -> bool:
    """Whether the grammar of `params` allows `text` so far (tokenized by the default model's tokenizer)."""
    tokenizer = llguidance.LLTokenizer((default_model.ASSETS / "tokenizer.json").read_text())
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(params))
    return matcher.consume_tokens(tokenizer.tokenize_str(text))
