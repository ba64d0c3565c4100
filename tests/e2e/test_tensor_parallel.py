"""Tensor parallelism: the multi-device checks (tensor_parallel_cases.py) in a process with four
CPU devices, and what one device can check here. (The eight-device checks of copied heads are
test_head_copies.py, a file of their own so that pytest-xdist runs the two processes side by side.)"""

from pathlib import Path

import pytest
from helpers import run_on_cpu_devices

from spec_jax import LLM


def test_on_four_cpu_devices():
    run_on_cpu_devices(Path(__file__).parent / "tensor_parallel_cases.py", 4)


def test_more_devices_than_there_are_is_refused(tiny_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must be an integer from 1 to the 1 cpu device"):
        LLM(str(tiny_dir), tensor_parallel_size=2, max_model_len=64)
