"""What several test files share, besides fixtures (those are in conftest.py): paths, the tiny
model's config, the drafter test configs and prompts, the relative error every numeric check uses,
and running a test file on several CPU devices. Importable from any folder of tests/ (pytest puts
tests/ on the path for its conftest.py)."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from models.dflash import DFlashConfig
from models.qwen3_5 import Qwen3_5Config
from spec_jax import SamplingParams

ROOT = Path(__file__).resolve().parent.parent  # the repository
FIXTURES = ROOT / "tests" / "fixtures"
HF_FIXTURES = FIXTURES / "hf"

TINY = Qwen3_5Config(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=24, rope_theta=10000.0, max_position_embeddings=1024,
    mtp_num_hidden_layers=1, eos_token_id=(511,),
)

# Block drafters of the tiny target: DFlash, and DSpark (the same backbone with a Markov head).
DRAFTER = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, target_layer_ids=(1, 4, 6), mask_token_id=510,
                       block_size=4, vocab_size=512)
DSPARK = dataclasses.replace(DRAFTER, markov_rank=8, sample_from_anchor=True)

DRAFT_GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def relative_error(got, want) -> float:
    """||got - want|| / ||want||, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def drafter_spec(method: str, model, k: int, **fields) -> dict:
    """The speculative config of a drafter method with its checkpoint folder."""
    return {"method": method, "model": str(model), "num_speculative_tokens": k, **fields}


def gdn_inputs(T, *, B=2, nk=2, nv=6, dk=16, dv=24, seed=0, gate_scale=2.0):
    """Random float32 inputs of the gated delta rule: (q, k, v, gates, beta, state), q and k
    [B, T, nk, dk], v [B, T, nv, dv], gates and beta [B, T, nv], state [B, nv, dk, dv]."""
    r = np.random.default_rng(seed)
    def f(*s):
        return jnp.asarray(r.normal(size=s), jnp.float32)
    g = -jnp.asarray(r.uniform(0, gate_scale, size=(B, T, nv)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(B, T, nv)), jnp.float32)
    return f(B, T, nk, dk), f(B, T, nk, dk), f(B, T, nv, dv), g, beta, f(B, nv, dk, dv)


def drafter_prompts() -> list[list[int]]:
    """Three prompts of 5, 17 and 40 tokens in the tiny model's vocabulary."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 500, n).tolist() for n in (5, 17, 40)]


def assert_greedy_equals_plain(llm, plain: list[list[int]]) -> None:
    """A speculating `llm` reproduces `plain` alone and in a mixed batch whose middle row opts out."""
    alone = llm.generate(prompt_token_ids=drafter_prompts()[:1], sampling_params=DRAFT_GREEDY)
    assert alone[0].outputs[0].token_ids == plain[0]
    params = [DRAFT_GREEDY, dataclasses.replace(DRAFT_GREEDY, speculative=False), DRAFT_GREEDY]
    mixed = llm.generate(prompt_token_ids=drafter_prompts(), sampling_params=params)
    assert [o.outputs[0].token_ids for o in mixed] == plain


def run_on_cpu_devices(cases: Path, devices: int) -> None:
    """Runs the pytest file `cases` in a process of its own with `devices` CPU devices (the device
    count is fixed when JAX starts) and asserts that it passed, with the end of its output."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    # From the repository root: in tests/ the test folders proposers/ and models/ would shadow the packages
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
