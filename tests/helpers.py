"""What several test files share, besides fixtures (those are in conftest.py): paths, the tiny
model's config, the drafter test configs and prompts, the relative error every numeric check uses,
and running a test file on several CPU devices. Importable from any folder of tests/ (pytest puts
tests/ on the path for its conftest.py)."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from safetensors.numpy import load_file, save_file

from models.dflash import DFlashConfig
from models.layers import Batch
from models.qwen3_5 import Qwen3_5Config, init_cache
from pallas_kernels.batch_invariant import batch_invariant
from spec_jax import SamplingParams
from spec_jax.writing.random_checkpoint import write_checkpoint

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

# The speculative-config field of a test not about adaptive verification: every draft verified every
# step, so its step compiles one verify width, not several (the adaptive step has tests of its own:
# tests/engine/test_adaptive.py and each method's greedy-equality test, at the default).
FIXED_K = {"enable_adaptive_verification": False}


def write_echo(folder: Path, layers: int) -> Path:
    """The model of conftest's `echo_dir` (whose docstring says what it is) in `folder`, with TINY's
    first `layers` layers (a whole number of its layer pattern)."""
    cfg = dataclasses.replace(TINY, vocab_size=64, eos_token_id=(63,), tie_word_embeddings=True,
                              num_hidden_layers=layers, layer_types=TINY.layer_types[:layers])
    d = write_checkpoint(folder, cfg, seed=3)
    t = load_file(str(d / "model.safetensors"))
    H, rng = cfg.hidden_size, np.random.default_rng(0)
    t["mtp.fc.weight"] = np.concatenate([np.eye(H), 3.0 * rng.normal(size=(H, H)) / np.sqrt(H)], 1).astype(np.float32)
    t["mtp.layers.0.self_attn.o_proj.weight"] *= 0.1
    t["mtp.layers.0.mlp.down_proj.weight"] *= 0.1
    save_file(t, str(d / "model.safetensors"))
    return d


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


def check_logits_do_not_depend_on_the_pass(model, others: int, cache_len: int) -> None:
    """Batch-invariant mode: positions 20..29 of one sequence decoded one token at a time, verified
    four at a time (a replay rollback committing two), prefilled whole beside `others` other rows,
    and resumed as a block from position 20 give the same logits, bit for bit."""
    rng = np.random.default_rng(0)
    seq, rest = rng.integers(0, 500, 30), rng.integers(0, 500, (others, 30))
    with batch_invariant(8):
        def forward(tokens, start, n, cache, keep):
            out = model(tokens, Batch(start, n), cache, kv_len=cache_len,
                        rollback=None if keep is None else "replay")
            cache = out.cache if keep is None else model.commit(out.cache, out.pending, keep)
            return model.logits(out.hidden), cache

        run = jax.jit(forward)
        empty = init_cache(model.cfg, 1, cache_len, model.dtype)
        one = lambda t: jnp.asarray(t, jnp.int32)  # noqa: E731
        logits, after_20 = run(one(seq[None, :20]), one([0]), one([20]), empty, None)
        decoded, cache = [logits[0, 19]], after_20
        for t in range(20, 29):
            logits, cache = run(one(seq[None, t:t + 1]), one([t]), one([1]), cache, None)
            decoded.append(logits[0, 0])
        decoded = np.stack(decoded)  # logits at positions 19..28

        verified, committed = run(one(seq[None, 20:24]), one([20]), one([4]), after_20, one([2]))
        np.testing.assert_array_equal(np.asarray(verified[0]), decoded[1:5])
        after_commit, _ = run(one(seq[None, 22:23]), one([22]), one([1]), committed, None)
        np.testing.assert_array_equal(np.asarray(after_commit[0, 0]), decoded[3])

        rows = others + 1
        batch, _ = run(one(np.concatenate([seq[None], rest])), one([0] * rows), one([30] * rows),
                       init_cache(model.cfg, rows, cache_len, model.dtype), None)
        np.testing.assert_array_equal(np.asarray(batch[0, 19:29]), decoded)

        block = np.zeros((1, 64), np.int32)
        block[0, :10] = seq[20:30]
        resumed, _ = run(one(block), one([20]), one([10]), after_20, None)
        np.testing.assert_array_equal(np.asarray(resumed[0, :9]), decoded[1:])
