"""The CLI and the embedded default model, as a new user meets them."""

import re

import numpy as np
import pytest
from helpers import FIXED_K, HF_FIXTURES

from spec_jax import LLM, SamplingParams
from spec_jax.api.cli import main


def test_generate_command_with_token_ids(capsys):
    ref = np.load(HF_FIXTURES / "dense_vl" / "reference.npz")
    ids = ",".join(map(str, ref["prompt_ids"].tolist()))
    rc = main(["generate", "--model", str(HF_FIXTURES / "dense_vl"), "--dtype", "float32",
               "--prompt-token-ids", ids, "--max-tokens", "8", "--max-model-len", "64", "--ignore-eos"])
    assert rc == 0
    assert str(ref["greedy_ids"][:8].tolist()) in capsys.readouterr().out


def test_generate_command_reports_bad_input(capsys):
    rc = main(["generate", "--model", str(HF_FIXTURES / "dense_vl"), "--prompt-token-ids", "1,2",
               "--max-tokens", "0"])
    assert rc == 2
    assert "max_tokens=0" in capsys.readouterr().err


def test_default_model_is_the_shipped_trained_one(capsys):
    from spec_jax import default_model

    llm = LLM(dtype="float32", max_model_len=128, max_num_seqs=2)
    assert llm.model_path == str(default_model.ASSETS)
    assert llm.cfg.mtp_num_hidden_layers == 1 and llm.model.mtp is not None
    out = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert llm.tokenizer.decode(llm.tokenizer.encode("def fibonacci(n):")) == "def fibonacci(n):"
    rc = main(["generate", "--prompt", "import os", "--max-tokens", "4", "--max-model-len", "128"])
    assert rc == 0
    assert "RANDOM" not in capsys.readouterr().err  # that note is for the random fallback only


def test_generate_command_stops_at_a_stop_string(capsys):
    # --max_tokens: vLLM's parser takes underscores as well as dashes
    argv = ["generate", "--prompt", "import os", "--max_tokens", "16", "--max-model-len", "128", "--ignore-eos"]
    assert main(argv) == 0
    text = capsys.readouterr().out.split("--- prompt: 'import os'\n", 1)[1].rstrip("\n")
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert main([*argv, "--stop", "never in it", "--stop", stop]) == 0
    out, err = capsys.readouterr()
    assert out.split("--- prompt: 'import os'\n", 1)[1].rstrip("\n") == text[:text.find(stop)]
    assert "finish=stop" in err


def test_generate_command_speculates(capsys):
    ref = np.load(HF_FIXTURES / "dense_vl" / "reference.npz")
    ids = ",".join(map(str, ref["prompt_ids"].tolist()))
    rc = main(["generate", "--model", str(HF_FIXTURES / "dense_vl"), "--dtype", "float32", "--prompt-token-ids", ids,
               "--max-tokens", "8", "--max-model-len", "64", "--ignore-eos",
               "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}', "--compare"])
    out = capsys.readouterr()
    assert rc == 0
    assert str(ref["greedy_ids"][:8].tolist()) in out.out
    assert "speculation mtp k=2: acceptance rate" in out.err
    assert re.search(r"speculation off: [\d.]+ tok/s\nspeculation on:  [\d.]+ tok/s \(mtp k=2, mean acceptance length "
                     r"[\d.]+\)\nspeedup [\d.]+x \(compilation excluded.*greedy output identical", out.out)
    assert main(["generate", "--model", str(HF_FIXTURES / "dense_vl"), "--prompt-token-ids", ids, "--compare"]) == 2
    assert "--compare needs --speculative-config" in capsys.readouterr().err


def test_random_checkpoint_script_writes_loadable_target_and_drafter(tmp_path):
    from spec_jax.writing.random_checkpoint import main as write

    write(["target", str(tmp_path / "t"), "--text-only"])
    write(["dflash", str(tmp_path / "d"), "--target", str(tmp_path / "t"), "--block-size", "4"])
    llm = LLM(model=str(tmp_path / "t"), dtype="float32", max_model_len=64, max_num_seqs=1,
              speculative_config={"method": "dflash", "model": str(tmp_path / "d"), "num_speculative_tokens": 3,
                                  **FIXED_K})
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=5, temperature=0))
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "99999"], "99999 is not a port number (0 to 65535)"),
    (["serve", "--port", "http"], "'http' is not a port number"),
])
def test_serve_refuses_a_bad_port(capsys, argv, message):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_generate_refuses_overflowing_stop_ids_and_zero_max_model_len(capsys):
    assert main(["generate", "--prompt-token-ids", "1,2", "--stop-token-ids", "99999999999"]) == 2
    assert "stop_token_ids[0]=99999999999 must be a token id" in capsys.readouterr().err
    assert main(["generate", "--prompt-token-ids", "1,2", "--max-model-len", "0"]) == 2
    assert "max_model_len=0 must be from 2 to" in capsys.readouterr().err
    assert main(["generate", "--prompt-token-ids", "1,2", "--max-num-seqs", "4", "--batch-buckets", "1,9"]) == 2
    assert "a batch bucket=9 must be between 1 and max_num_seqs=4" in capsys.readouterr().err


def test_serve_bounds_the_graceful_shutdown(monkeypatch, tiny_dir):
    """SIGTERM drains in-flight requests for at most --timeout-graceful-shutdown seconds (uvicorn
    stops waiting then); the default is 30."""
    import uvicorn

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    assert main(["serve", "--model", str(tiny_dir), "--dtype", "float32", "--max-model-len", "64",
                 "--timeout-graceful-shutdown", "5"]) == 0
    assert seen["timeout_graceful_shutdown"] == 5.0
    assert main(["serve", "--model", str(tiny_dir), "--dtype", "float32", "--max-model-len", "64"]) == 0
    assert seen["timeout_graceful_shutdown"] == 30.0
    with pytest.raises(SystemExit) as exit_:  # refused as the flags are read, before the model loads
        main(["serve", "--model", str(tiny_dir), "--timeout-graceful-shutdown", "-1"])
    assert exit_.value.code == 2


def test_integer_lists_are_checked_as_the_flags_are_read(capsys, monkeypatch):
    """A malformed id list is refused before any model loads (argparse's exit status 2)."""
    import spec_jax.api.cli as cli

    monkeypatch.setattr(cli, "load_llm", lambda args: pytest.fail("the model loaded before the flags were checked"))
    for argv in (["generate", "--prompt-token-ids", "1,2,x"], ["generate", "--prompt", "a", "--stop-token-ids", "1,y"],
                 ["generate", "--prompt", "a", "--batch-buckets", "1,two"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and "is not a comma-separated list of integers" in capsys.readouterr().err
