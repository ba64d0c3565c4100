"""Shared fixtures: tiny random checkpoints written by our own writer, HF fixtures on disk."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("SPEC_JAX_XLA_CACHE", str(Path(__file__).parent.parent / ".venv" / "xla-cache"))

from models.qwen3_5 import Qwen3_5Config  # noqa: E402
from spec_jax.random_checkpoint import write_checkpoint  # noqa: E402

HF_FIXTURES = Path(__file__).parent / "fixtures" / "hf"

TINY = Qwen3_5Config(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=24, rope_theta=10000.0, max_position_embeddings=1024,
    mtp_num_hidden_layers=1, eos_token_id=(511,),
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A random tiny dense checkpoint in the VL-wrapped layout, with an MTP head."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TINY, seed=1)


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    from spec_jax import LLM

    return LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=4)
