"""Generated malformed configs thrown at the parsers: every one is accepted or refused with a
clean ValueError (CheckpointError for config.json) that names the field; never a TypeError,
RecursionError or OverflowError from inside the parser."""

import dataclasses
import json
import math
import re
import warnings
from pathlib import Path

from conftest import TINY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.qwen3_5 import Qwen3_5Config
from spec_jax.engine.spec_config import FIELD_NAMES, SpeculativeConfig, parse_speculative_config
from spec_jax.loading.source import CheckpointError, parse_config
from spec_jax.writing.random_checkpoint import hf_config


def fuzz(n: int) -> settings:
    """n examples, reproducible (no example database, a fixed seed), no time limits."""
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                    derandomize=True)

# JSON values of every kind, the awkward ones weighted in: huge and negative integers, non-finite
# floats, strings of numbers, nesting.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                    st.sampled_from(["mtp", "ngram", "dflash", "eagle3", "synthetic", "greedy", "1", "", "[ngram]"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                            max_size=3), max_leaves=8)

spec_configs = st.dictionaries(st.sampled_from([*FIELD_NAMES, "tensor_parallel_size", "unknown_key"]), values,
                               max_size=6)


def names_a_field(message: str, keys) -> bool:
    return any(str(k) in message for k in keys) or bool(re.search(r"speculative|method|num_speculative_tokens",
                                                                   message))


@fuzz(10_000)
@given(spec_configs)
def test_generated_speculative_configs(raw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = parse_speculative_config(raw, target_model="target")
        except ValueError as e:
            assert type(e) is ValueError, f"{type(e).__name__}: {e}"
            assert names_a_field(str(e), raw), f"{raw!r} -> {e}"
            return
    assert config is None or isinstance(config, SpeculativeConfig)
    if config is not None:
        assert 1 <= config.num_speculative_tokens <= 64
        hash(config)  # static under jit


def tiny_config() -> dict:
    return hf_config(dataclasses.replace(TINY, eos_token_id=(511,)), vl_wrapped=False)


KEYS = sorted(tiny_config())


@fuzz(1_000)
@given(st.lists(st.tuples(st.sampled_from(KEYS), values), min_size=1, max_size=3))
def test_generated_config_json_variants(edits):
    config = tiny_config()
    for key, value in edits:
        config[key] = value
    try:
        cfg = parse_config(config, Path("model/config.json"), Qwen3_5Config.from_hf)
    except CheckpointError as e:
        assert str(e).startswith("model/config.json"), str(e)
        assert any(key in str(e) for key, _ in edits) or "model_type" in str(e) or "layer_types" in str(e), \
            f"{edits!r} -> {e}"
        return
    for name in Qwen3_5Config.POSITIVE:
        assert isinstance(getattr(cfg, name), int) and getattr(cfg, name) >= 1
    assert math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0
    json.dumps(dataclasses.asdict(cfg))  # plain data throughout
