"""Tensor parallelism past the head counts: the checks of head_copies_cases.py in a process with
eight CPU devices."""

from pathlib import Path

from helpers import run_on_cpu_devices


def test_on_eight_cpu_devices():
    run_on_cpu_devices(Path(__file__).parent / "head_copies_cases.py", 8)
