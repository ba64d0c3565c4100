"""`python -m spec_jax.writing.random_checkpoint <method> DIR --target T` writes a drafter in each published
layout that loads and speculates on the target it was fitted to, output equal to plain decoding."""

import numpy as np
import pytest

from spec_jax import SamplingParams
from spec_jax.writing.random_checkpoint import main

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CASES = [  # (writer kind, extra flags, speculative config without model)
    ("dflash", [], {"method": "dflash", "num_speculative_tokens": 15}),
    ("dspark", ["--layout", "dspark"], {"method": "dspark", "num_speculative_tokens": 7}),
    ("dspark", ["--layout", "speculators"], {"method": "dspark", "num_speculative_tokens": 7}),
    ("eagle3", [], {"method": "eagle3", "num_speculative_tokens": 2}),
    ("draft_model", [], {"method": "draft_model", "num_speculative_tokens": 2}),
]


@pytest.mark.parametrize("kind, flags, spec", CASES, ids=[f"{c[0]}{'-' + c[1][1] if c[1] else ''}" for c in CASES])
def test_written_drafter_speculates_on_its_target(tiny_dir, tiny_llm, tmp_path, kind, flags, spec):
    main([kind, str(tmp_path / kind), "--target", str(tiny_dir), *flags])
    prompts = [np.random.default_rng(0).integers(0, 500, 9).tolist()]
    plain = tiny_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)[0].outputs[0].token_ids
    llm = tiny_llm.with_speculation({**spec, "model": str(tmp_path / kind)})
    assert llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)[0].outputs[0].token_ids == plain
    assert llm.metrics["num_draft_tokens"] > 0


def test_unknown_drafter_kind_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["medusa", str(tmp_path)])
    assert "invalid choice: 'medusa'" in capsys.readouterr().err
