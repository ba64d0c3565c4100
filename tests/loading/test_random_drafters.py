"""`python -m spec_jax.writing.random_checkpoint <method> DIR --target T` writes a drafter in each published
layout that loads and speculates on the target it was fitted to, output equal to plain decoding."""

import numpy as np
import pytest
from helpers import FIXED_K

from spec_jax import SamplingParams
from spec_jax.writing.random_checkpoint import main

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SLIDING = ["--layer-types", "sliding,sliding", "--sliding-window", "4"]
CASES = {  # id: (writer kind, extra flags, speculative config without model)
    "dflash": ("dflash", [], {"method": "dflash", "num_speculative_tokens": 15}),
    "dflash-sliding-full": ("dflash", ["--layer-types", "sliding,full", "--sliding-window", "4"],
                            {"method": "dflash", "num_speculative_tokens": 15}),
    "dflash2": ("dflash", ["--dflash2", *SLIDING, "--causal", "false"],
                {"method": "dflash", "num_speculative_tokens": 15}),
    "dspark-dspark": ("dspark", ["--layout", "dspark"], {"method": "dspark", "num_speculative_tokens": 7}),
    "dspark-speculators": ("dspark", ["--layout", "speculators"], {"method": "dspark", "num_speculative_tokens": 7}),
    "dspark-speculators-sliding": ("dspark", ["--layout", "speculators", *SLIDING],
                                   {"method": "dspark", "num_speculative_tokens": 7}),
    "eagle3": ("eagle3", [], {"method": "eagle3", "num_speculative_tokens": 2}),
    "eagle3-sliding": ("eagle3", ["--sliding-window", "4"], {"method": "eagle3", "num_speculative_tokens": 2}),
    "draft_model": ("draft_model", [], {"method": "draft_model", "num_speculative_tokens": 2}),
}


@pytest.mark.parametrize("kind, flags, spec", CASES.values(), ids=CASES.keys())
def test_written_drafter_speculates_on_its_target(tiny_dir, tiny_llm, tmp_path, kind, flags, spec):
    main([kind, str(tmp_path / kind), "--target", str(tiny_dir), *flags])
    prompts = [np.random.default_rng(0).integers(0, 500, 9).tolist()]
    plain = tiny_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)[0].outputs[0].token_ids
    llm = tiny_llm.with_speculation({**spec, "model": str(tmp_path / kind), **FIXED_K})
    assert llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)[0].outputs[0].token_ids == plain
    assert llm.metrics["num_draft_tokens"] > 0


def test_layer_flags_a_kind_does_not_take_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["eagle3", str(tmp_path), "--target", str(tmp_path), "--layer-types", "sliding"])
    assert "eagle3 takes none of --layer-types" in capsys.readouterr().err


def test_unknown_drafter_kind_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["medusa", str(tmp_path)])
    assert "invalid choice: 'medusa'" in capsys.readouterr().err
