"""bench.prefix_cache's timeline of one prefill's programs, from its device events: each program's
first start and last end from the prefill's first kernel, transfers outside programs left out."""

from bench.prefix_cache import program_timeline
from bench.step_profile import Event


def test_each_programs_start_and_end_from_the_prefills_first_kernel():
    spans = {"jit_restore_blocks": [(100, 100.5), (100.6, 101.2)], "jit_prefill_block": [(110.5, 128), (103, 110)],
             "jit_start_decode": [(128.2, 128.8)], "?": [(99.0, 99.1)]}
    events = [Event(f"k{i}", "", a * 1e6, (b - a) * 1e6, (b - a) * 1e6, module)
              for module, pairs in spans.items() for i, (a, b) in enumerate(pairs)]
    got = program_timeline(events)
    assert set(got) == {"jit_restore_blocks", "jit_prefill_block", "jit_start_decode"}
    expect = {"jit_restore_blocks": (0.0, 1.2), "jit_prefill_block": (3.0, 28.0), "jit_start_decode": (28.2, 28.8)}
    for module, (start, end) in expect.items():
        assert abs(got[module]["start_ms"] - start) < 1e-9 and abs(got[module]["end_ms"] - end) < 1e-9, module
    assert program_timeline([]) == {}
