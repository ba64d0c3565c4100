"""gpu_memory_utilization sets the JAX allocator's share before the backend starts, keeps a share
the environment names, and says so when the backend started first with a smaller one."""

import json
import logging
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from spec_jax.engine import memory


PROBE = """
import json, os, sys
from spec_jax.engine.memory import claim_device_memory
share = claim_device_memory(json.loads(sys.argv[1]))
print(json.dumps({"share": share, "env": {k: os.environ.get(k) for k in
                  ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")}}))
"""


def probe(utilization, **env) -> dict:
    """claim_device_memory(utilization) in a fresh process (no backend started) with `env` set."""
    clean = {k: v for k, v in os.environ.items() if k not in memory.SHARE_VARIABLES}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(utilization)], env={**clean, **env}, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_default_share_is_vllms_ninety_percent():
    got = probe(None)
    assert got["share"] == 0.9 and got["env"]["XLA_CLIENT_MEM_FRACTION"] == "0.9"


def test_an_explicit_utilization_overrides_the_variable_the_user_set():
    got = probe(0.6, XLA_PYTHON_CLIENT_MEM_FRACTION="0.8")
    assert got["share"] == 0.6
    assert got["env"] == {"XLA_CLIENT_MEM_FRACTION": None, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"}


def test_a_share_the_environment_names_is_kept_without_an_argument():
    got = probe(None, XLA_CLIENT_MEM_FRACTION="0.5")
    assert got["share"] == 0.5 and got["env"]["XLA_CLIENT_MEM_FRACTION"] == "0.5"


class StartedGPU:
    platform = "gpu"


def test_a_started_backend_with_a_smaller_share_is_named_with_the_fix(monkeypatch, caplog):
    monkeypatch.setattr(memory.xla_bridge, "backends_are_initialized", lambda: True)
    monkeypatch.setattr(memory.xla_bridge, "get_backend", lambda: StartedGPU())
    for name in memory.SHARE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING, logger="spec_jax"):
        assert memory.claim_device_memory(0.95) == memory.JAX_DEFAULT_SHARE
    assert "gpu_memory_utilization=0.95 cannot take effect" in caplog.text
    assert "XLA_CLIENT_MEM_FRACTION=0.95" in caplog.text


@pytest.mark.parametrize("share, warned", [(None, True), ("0.5", False)])
def test_without_an_argument_only_jaxs_own_default_is_warned_of(monkeypatch, caplog, share, warned):
    """A started backend at JAX's 75% is below vLLM's 90%; a share the user named is theirs."""
    monkeypatch.setattr(memory.xla_bridge, "backends_are_initialized", lambda: True)
    monkeypatch.setattr(memory.xla_bridge, "get_backend", lambda: StartedGPU())
    for name in memory.SHARE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if share:
        monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", share)
    with caplog.at_level(logging.WARNING, logger="spec_jax"):
        assert memory.claim_device_memory(None) == float(share or memory.JAX_DEFAULT_SHARE)
    assert ("cannot take effect" in caplog.text) == warned


def test_importing_the_package_starts_no_backend():
    """The share is set when LLM is built: importing the package and its front ends must not
    start JAX's backend first (it would fix the allocator's share at JAX's default)."""
    code = ("import spec_jax, spec_jax.api.cli, spec_jax.api.server, bench.models; "
            "from jax._src import xla_bridge; print(xla_bridge.backends_are_initialized())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
