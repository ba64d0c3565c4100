"""bench.tensor_parallel refuses a size order or a size the equality or the machine cannot serve,
before it draws any weights. (The whole bench runs on four CPU devices in a few minutes; the
tensor-parallel cases check the engine itself.)"""

import pytest

from bench.tensor_parallel import parse_args


def test_the_equality_needs_tp_1_first(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--tp", "2", "1"])
    assert "the greedy equality compares against TP = 1, which must come first" in capsys.readouterr().err
    assert parse_args(["--tp", "1", "--prompts", "0"]).tp == [1]


def test_a_size_above_the_device_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--tp", "1", "2"])  # the test process has one CPU device
    assert "--tp 2 needs 2 devices; this machine has 1" in capsys.readouterr().err
