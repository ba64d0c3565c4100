"""Generated malformed configs thrown at the parsers: every one is accepted or refused with a
clean ValueError (CheckpointError for config.json) that names the field; never a TypeError,
RecursionError or OverflowError from inside the parser."""

import dataclasses
import json
import math
import random
import re
import warnings
from pathlib import Path

from helpers import TINY
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

METHOD_LIKE = ["mtp", "ngram", "dflash", "eagle3", "synthetic", "greedy", "1", "", "[ngram]"]
# JSON values of every kind, the awkward ones weighted in: huge and negative integers, non-finite
# floats, strings of numbers, nesting.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.sampled_from(METHOD_LIKE))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                            max_size=3), max_leaves=8)

SPEC_KEYS = [*FIELD_NAMES, "tensor_parallel_size", "unknown_key"]


def random_value(rng: random.Random, leaves: int = 8):
    """A JSON value of the kinds `values` draws (the awkward scalars, lists, dicts, nesting), made
    directly: 10,000 of these cost milliseconds where hypothesis' recursive strategy costs 5 ms each."""
    kind = rng.randrange(10 if leaves > 1 else 8)
    if kind == 8:
        return [random_value(rng, leaves // 2) for _ in range(rng.randrange(5))]
    if kind == 9:
        return {"".join(rng.choices("ab\u00e9_ 1", k=rng.randrange(5))): random_value(rng, leaves // 2)
                for _ in range(rng.randrange(4))}
    return [None, rng.random() < 0.5, rng.randint(-(2**70), 2**70), rng.randint(-3, 70),
            rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, rng.uniform(-1e3, 1e3)]),
            "".join(rng.choices("0123456789.-e xyz", k=rng.randrange(9))), rng.choice(METHOD_LIKE),
            rng.choice(METHOD_LIKE)][kind]


def names_a_field(message: str, keys) -> bool:
    return any(str(k) in message for k in keys) or bool(re.search(r"speculative|method|num_speculative_tokens",
                                                                   message))


def test_generated_speculative_configs():
    """10,000 generated configs of up to 6 keys (seeded)."""
    rng = random.Random(0)
    for _ in range(10_000):
        raw = {rng.choice(SPEC_KEYS): random_value(rng) for _ in range(rng.randrange(7))}
        check_speculative_config(raw)


def check_speculative_config(raw: dict) -> None:
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
