"""Tensor parallelism: the multi-device checks (tensor_parallel_cases.py) in a process with four
CPU devices, and what one device can check here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spec_jax import LLM

HERE = Path(__file__).parent


@pytest.mark.parametrize("cases, devices", [("tensor_parallel_cases.py", 4), ("head_copies_cases.py", 8)])
def test_on_cpu_devices(cases, devices):
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    # From the repository root: in tests/ the test folders proposers/ and models/ would shadow the packages
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / cases)],
                         env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]


def test_more_devices_than_there_are_is_refused(tiny_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must be an integer from 1 to the 1 cpu device"):
        LLM(str(tiny_dir), tensor_parallel_size=2, max_model_len=64)
