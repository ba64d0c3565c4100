"""Issue 57's offline rows: bad input to `LLM.chat`, prefix caching, `SamplingParams`, the
`generate` and `bench` commands, converted and GGUF checkpoints and speculative configs is refused
with a ValueError naming the argument and what it accepts; Ctrl-C ends a run at once."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import gguf
import pytest

from spec_jax import LLM, SamplingParams
from spec_jax.api.batch_eval import read_requests, run_file
from spec_jax.api.cli import main
from spec_jax.engine.spec_config import parse_speculative_config
from spec_jax.loading import load_model
from spec_jax.loading.source import CheckpointError
from spec_jax.writing.gguf_writer import write_gguf

MESSAGE = {"role": "user", "content": "hi"}
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}"
CONVERSATIONS = "messages must be a non-empty list of {role, content} dicts, or a list of such lists"


# ----------------------------------------------------------------------------- LLM.chat


@pytest.mark.parametrize("messages, template, message", [
    (None, None, CONVERSATIONS),
    (5, None, CONVERSATIONS),
    ([[MESSAGE], 5], None, CONVERSATIONS),
    (MESSAGE, None, CONVERSATIONS),
    ([MESSAGE], "{% for i in range(10**9) %}{% endfor %}", "the chat template cannot render these messages: .*Range"),
    ([MESSAGE], "{% include 'other.jinja' %}", "the chat template includes or imports 'other.jinja'"),
    ([{"content": "hi"}], TEMPLATE, r"messages\[0\].role must be a string .*got None"),
    ([{"role": None, "content": "hi"}], TEMPLATE, r"messages\[0\].role must be a string .*got None"),
    ([MESSAGE, {"role": 5, "content": "hi"}], TEMPLATE, r"messages\[1\].role must be a string .*got 5"),
])
def test_chat_refuses_malformed_messages_and_templates_by_name(tiny_llm, messages, template, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.chat(messages, SamplingParams(max_tokens=1), chat_template=template or TEMPLATE, use_tqdm=False)


def test_apply_chat_template_refuses_a_message_that_is_not_an_object():
    from spec_jax.api.chat import ChatTemplate, ChatTokenizer

    with pytest.raises(ValueError, match=r"messages\[1\] must be an object with a role and content, got 5"):
        ChatTokenizer(None, ChatTemplate(TEMPLATE)).apply_chat_template([MESSAGE, 5], tokenize=False)


def test_chat_refuses_an_add_generation_prompt_that_is_not_a_bool(tiny_llm):
    with pytest.raises(ValueError, match="add_generation_prompt='yes' must be True or False"):
        tiny_llm.chat([MESSAGE], SamplingParams(max_tokens=1), chat_template=TEMPLATE, add_generation_prompt="yes")


# ----------------------------------------------------------------------------- prefix caching


@pytest.mark.parametrize("kwargs, message", [
    (dict(enable_prefix_caching=True, prefix_block_size=2**20),
     "prefix_block_size=1048576 must be a positive multiple of 64 .*up to 256"),
    (dict(enable_prefix_caching=True, prefix_block_size=2**26), "prefix_block_size=67108864 must be"),
    (dict(prefix_block_size=100), "prefix_block_size=100 must be a positive multiple of 64 .*up to 256"),
    (dict(prefix_block_size=2**20), "prefix_block_size=1048576 must be"),
    (dict(prefix_block_size=True), "prefix_block_size=True must be"),
    (dict(enable_prefix_caching=True, prefix_cache_gb=True), "prefix_cache_gb=True must be a positive number"),
    (dict(prefix_cache_gb=-1), "prefix_cache_gb=-1 must be a positive number"),
])
def test_prefix_block_size_is_bounded_by_max_model_len(tiny_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tiny_dir), dtype="float32", max_model_len=200, **kwargs)


def test_a_block_may_reach_max_model_len_rounded_up_to_64(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=100, enable_prefix_caching=True,
              prefix_block_size=128)
    assert llm.engine.prefix_cache.block_size == 128 and llm.engine.config.cache_len == 128


# ----------------------------------------------------------------------------- SamplingParams


FLUSHED = "; as float32, the dtype it is used in, it is 0.0"


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=1e39), r"temperature=1e\+39 must be >= 0 .*as a finite float32"),
    (dict(temperature=10**400), "temperature=.* must be >= 0 .*as a finite float32"),
    (dict(top_p=1e-50), r"top_p=1e-50 must be in \(0, 1\].*" + FLUSHED),
    (dict(repetition_penalty=1e-300), r"repetition_penalty=1e-300 must be > 0.*" + FLUSHED),
    (dict(repetition_penalty=1e-40), r"repetition_penalty=1e-40 must be > 0.*" + FLUSHED),
    (dict(repetition_penalty=1e308), "repetition_penalty=1e.308 must be > 0 .*as a finite float32"),
    (dict(logit_bias={3: 1e39}), r"logit_bias\[3\]=1e\+39 must be a finite number.*as a finite float32"),
    (dict(n=10**5000), "n=an integer of 16610 bits must be a positive number"),
])
def test_sampling_params_are_checked_as_the_float32_the_device_uses(kwargs, message):
    with pytest.raises(ValueError, match=message) as refused:
        SamplingParams(**kwargs)
    assert type(refused.value) is ValueError


# ----------------------------------------------------------------------------- Ctrl-C


def interrupt(argv: list[str]) -> tuple[int, str]:
    """Run `spec-jax argv` until it has loaded its model, send SIGINT two seconds later, while it
    compiles or runs the device loop: (exit status, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "spec_jax.api.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    err = ""
    while "loaded " not in err:
        line = proc.stderr.readline()
        assert line, f"exited before loading: {err}"
        err += line
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    try:
        rest = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    return proc.returncode, err + rest


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_ctrl_c_ends_a_run_at_once_with_status_130(tiny_dir, tmp_path, command):
    common = ["--model", str(tiny_dir), "--dtype", "float32", "--max-model-len", "1024"]
    if command == "generate":
        argv = ["generate", *common, "--prompt-token-ids", "1,2,3", "--max-tokens", "1000", "--ignore-eos"]
    else:
        (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_token_ids": [i, 2, 3], "max_tokens": 1000,
                                                              "ignore_eos": True}) + "\n" for i in range(8)))
        argv = ["bench", *common, "--input", str(tmp_path / "p.jsonl"), "--no-warmup"]
    status, err = interrupt(argv)
    assert status == 130, err
    assert "Traceback" not in err and "terminate called" not in err, err
    assert "interrupted" in err


# ----------------------------------------------------------------------------- bench JSONL


@pytest.mark.parametrize("line, message", [
    ("[" * 100_000 + "]" * 100_000, "line 2: nests too deeply"),
    ('{"prompt_token_ids": [1], "id": ' + "[" * 100_000 + "]" * 100_000 + "}", "line 2: nests too deeply"),
    ('{"prompt_token_ids": [1], "id": {"a": [1]}}', r"line 2: id must be a string or a number, got \{'a': \[1\]\}"),
    ('{"prompt_token_ids": [1], "id": [1, 2]}', "line 2: id must be a string or a number"),
])
def test_a_deep_or_nested_line_is_named(tiny_llm, tmp_path, line, message):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt_token_ids": [1, 2]}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_requests(tiny_llm, src, max_tokens=8, temperature=0.0)


def test_bench_names_a_deep_line_with_status_2(tiny_dir, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    assert main(["bench", "--model", str(tiny_dir), "--dtype", "float32", "--max-model-len", "64",
                 "--input", str(tmp_path / "p.jsonl")]) == 2
    assert "line 1: nests too deeply" in capsys.readouterr().err


@pytest.mark.parametrize("separator", ["\u2028", "\u0085", "\u2029", "\x0c", "\r"])
def test_lines_split_on_newline_only(tiny_llm, tmp_path, separator):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [1, 2], "id": f"a{separator}b"}, ensure_ascii=False) + "\r\n"
                   + json.dumps({"prompt_token_ids": [3], "id": "c"}) + "\n")
    first, second = read_requests(tiny_llm, src, max_tokens=8, temperature=0.0)
    assert (first.id, first.line, second.id, second.line) == (f"a{separator}b", 1, "c", 2)


@pytest.mark.parametrize("flag", ["--output", "--metrics"])
def test_an_output_path_that_is_a_folder_is_refused_before_loading(tmp_path, capsys, monkeypatch, flag):
    import spec_jax.api.cli as cli

    (tmp_path / "p.jsonl").write_text('{"prompt_token_ids": [1, 2]}\n')
    (tmp_path / "folder").mkdir()
    monkeypatch.setattr(cli, "load_llm", lambda args: pytest.fail("loaded the model before checking the paths"))
    assert main(["bench", "--input", str(tmp_path / "p.jsonl"), flag, str(tmp_path / "folder")]) == 2
    assert f"cannot write {tmp_path / 'folder'}: it is a folder" in capsys.readouterr().err


def test_run_file_refuses_a_folder_before_generating(tiny_llm, tmp_path, monkeypatch):
    import spec_jax.api.batch_eval as batch_eval

    (tmp_path / "p.jsonl").write_text('{"prompt_token_ids": [1, 2]}\n')
    monkeypatch.setattr(batch_eval, "run", lambda *a, **k: pytest.fail("generated before checking the output path"))
    with pytest.raises(ValueError, match="it is a folder"):
        run_file(tiny_llm, str(tmp_path / "p.jsonl"), metrics_path=str(tmp_path))


# ----------------------------------------------------------------------------- checkpoints


def test_an_orbax_marker_with_malformed_quantized_is_named(tiny_dir, tmp_path):
    d = tmp_path / "converted"
    d.mkdir()
    shutil.copy(tiny_dir / "config.json", d / "config.json")
    for marker, message in (({"quantized": [1]}, "'quantized' must be an object of module path -> format, got a list"),
                            ({"quantized": {"layers.0.mlp": 5}}, "'quantized' maps 'layers.0.mlp' to 5; a format is"),
                            ({"quantized": {"layers.0.mlp": "int3"}}, "'quantized' maps 'layers.0.mlp' to 'int3'"),
                            ({"quantized": {"layers.0.mlp": "int8"}}, "layers.0.mlp is not a float Linear"),
                            ({"dtype": [1]}, "unknown dtype"),
                            ({"files": [1]}, "'files' must be an object of file name -> size in bytes, got")):
        (d / "spec_jax.json").write_text(json.dumps({"format": "orbax", **marker}))
        with pytest.raises(CheckpointError, match=f"spec_jax.json: {message}"):
            load_model(d)


def test_a_gguf_block_count_that_is_a_string_is_named(tiny_dir, tmp_path, monkeypatch):
    def as_text(writer, count):
        writer.add_string(gguf.Keys.LLM.BLOCK_COUNT.format(arch=writer.arch), str(count))
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", as_text)
    write_gguf(tiny_dir, tmp_path / "t.gguf")
    with pytest.raises(CheckpointError, match=r"t.gguf: metadata qwen35.block_count = .9. must be an integer >= 0"):
        load_model(tmp_path / "t.gguf")


# ----------------------------------------------------------------------------- speculative configs


@pytest.mark.parametrize("config, message", [
    ('{"method": "ngram", "num_speculative_tokens": ' + "7" * 5000 + "}",
     "speculative_config.num_speculative_tokens must be int, got an integer beyond 64 bits"),
    ({"method": "ngram", "num_speculative_tokens": 10**5000},
     "speculative_config.num_speculative_tokens must be int, got an integer beyond 64 bits"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "synthetic_acceptance_rates": [' + "7" * 5000 + "]}",
     "speculative_config.synthetic_acceptance_rates holds an integer beyond 64 bits"),
    ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 10**5000},
     "speculative_config.suffix_decoding_max_tree_depth must be int, got an integer beyond 64 bits"),
    ({"method": "draft_model", "model": "draft\0dir", "num_speculative_tokens": 2},
     "speculative_config.model must be a path or a Hugging Face repo id; 'draft\\\\x00dir' has a NUL byte"),
    ({"method": "mtp", "model": "a\0b"}, "speculative_config.model must be a path"),
])
def test_speculative_config_values_python_cannot_handle_are_named(config, message):
    with pytest.raises(ValueError, match=message) as refused:
        parse_speculative_config(config, target_model="target")
    assert type(refused.value) is ValueError


@pytest.mark.parametrize("method", ["draft_model", "dflash", "eagle3"])
def test_a_drafter_path_that_is_no_checkpoint_folder_is_named(tiny_llm, tmp_path, method):
    (tmp_path / "empty").mkdir()
    for path, found in ((tmp_path / "absent", "does not exist"), (tmp_path / "empty", "has no config.json")):
        with pytest.raises(ValueError, match=re.escape(f"speculative_config.model='{path}' {found}; method "
                                                       f"'{method}' needs the drafter's checkpoint folder")):
            tiny_llm.with_speculation({"method": method, "model": str(path), "num_speculative_tokens": 2})
