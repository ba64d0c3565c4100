"""Shared fixtures: tiny random checkpoints written by our own writer, the LLMs over them (the
helpers they share with the tests are in helpers.py), and the environment every test runs in."""

import os
from pathlib import Path

import pytest

# XLA's CPU backend at its cheapest optimisation: the tests' programs are tiny and compiled once
# each, so compile time dominates most tests (those run about 1.3x faster, the interpret-mode Pallas
# kernels included; the few that generate thousands of tokens run slower). Flags the caller set
# come after these, so theirs win.
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
WORKER_CPUS = "SPEC_JAX_TEST_WORKER_CPUS"  # the CPUs this xdist worker keeps to, once it took them


def keep_to_this_workers_cpus() -> None:
    """Under pytest-xdist, each worker runs on its own share of the CPUs (every n-th, n workers).
    XLA's CPU runtime splits a program over as many threads as its process may use CPUs; two
    workers splitting theirs over the same two cores wait on threads the other keeps off the CPU:
    2048 sampled requests ran 10x slower beside another busy process than on one core of their own.
    Processes a test starts (notebook kernels, the multi-device runs) inherit the share, and a
    pytest among them keeps it (WORKER_CPUS says it was taken)."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or workers is None or WORKER_CPUS in os.environ or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = cpus[int(worker.removeprefix("gw")) % len(cpus)::int(workers)]
    os.sched_setaffinity(0, share)
    os.environ[WORKER_CPUS] = ",".join(map(str, share))


keep_to_this_workers_cpus()  # before JAX starts: it sizes its thread pools then
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("SPEC_JAX_XLA_CACHE", str(Path(__file__).parent.parent / ".venv" / "xla-cache"))
# Every program goes to the persistent cache, not only those that compile for a second or more (the
# runtime's rule): the suite compiles thousands of small programs, many of them again in another test.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
if FAST_COMPILE_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # once: a pytest started from a test sees them set
    os.environ["XLA_FLAGS"] = f"{FAST_COMPILE_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()

from helpers import DRAFT_GREEDY, TINY, drafter_prompts, write_echo  # noqa: E402
from spec_jax.engine.runner import enable_compilation_cache  # noqa: E402
from spec_jax.writing.random_checkpoint import write_checkpoint  # noqa: E402

# Under pytest-xdist the slowest test files are handed out first (see slow_files_first.py).
pytest_plugins = ["slow_files_first"]

# Every test shares the persistent compilation cache, not only those that build an LLM: a program
# another test compiled is read back instead of compiled again.
enable_compilation_cache()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A random tiny dense checkpoint in the VL-wrapped layout, with an MTP head."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TINY, seed=1)


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    """The tiny model with one batch bucket: a lone prompt runs in the same compiled program as a
    batch of up to four, so a test's "alone" and "mixed" runs compile once (and every
    `with_speculation` of it inherits the bucket)."""
    from spec_jax import LLM

    return LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=4, batch_buckets=[4])


@pytest.fixture(scope="session")
def echo_dir(tmp_path_factory):
    """A tiny model whose drafts are often right: with tied, large embeddings the target tends to
    repeat tokens, and its MTP head is made to copy its input token plus noise from the hidden
    state, so drafts are accepted at every count from none to all (0.4, 0.3, 0.1 at k = 3)."""
    return write_echo(tmp_path_factory.mktemp("echo"), TINY.num_hidden_layers)


@pytest.fixture(scope="session")
def shallow_echo_dir(tmp_path_factory):
    """`echo_dir`'s model with one repeat of TINY's layer pattern instead of two, for the tests that
    sample thousands of requests to compare distributions: each request is a prefill padded to 64
    positions, most of their run time, and what they test (speculation keeps the distribution of
    the tokens sampled) holds at any depth."""
    return write_echo(tmp_path_factory.mktemp("shallow-echo"), len(TINY.pattern))


@pytest.fixture(scope="session")
def plain_greedy(tiny_llm) -> list[list[int]]:
    """The tiny model's greedy completions of `drafter_prompts()`, speculation off."""
    outs = tiny_llm.generate(prompt_token_ids=drafter_prompts(), sampling_params=DRAFT_GREEDY)
    return [o.outputs[0].token_ids for o in outs]
