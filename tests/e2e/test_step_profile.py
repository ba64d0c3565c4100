"""The profiler summary's self times: nested events are subtracted from their parent, back-to-back
kernels whose timestamps overlap by a few ns are not; collectives are a category of their own; a
trace of several GPUs can be read one device at a time."""

from types import SimpleNamespace

from bench.step_profile import category, read_events, with_self_times


def self_times(raw):
    return {e.name: e.self_ns for e in with_self_times(raw)}


def test_back_to_back_kernels_keep_their_whole_durations():
    # the second kernel's start is stamped 3 ns before the first one's end
    raw = [("solve", "", 0.0, 250_000.0), ("wy", "", 249_997.0, 85_000.0), ("state", "", 334_990.0, 170_000.0)]
    assert self_times(raw) == {"solve": 250_000.0, "wy": 85_000.0, "state": 170_000.0}


def test_an_event_inside_another_is_subtracted_from_it():
    raw = [("thunk", "", 0.0, 100.0), ("kernel", "", 10.0, 60.0), ("next", "", 100.0, 5.0)]
    assert self_times(raw) == {"thunk": 40.0, "kernel": 60.0, "next": 5.0}


def test_a_child_stamped_a_few_ns_past_its_parent_still_nests():
    raw = [("thunk", "", 0.0, 100_000.0), ("a", "", 10_000.0, 40_000.0), ("b", "", 60_000.0, 40_003.0)]
    assert self_times(raw) == {"thunk": 19_997.0, "a": 40_000.0, "b": 40_003.0}


def test_collectives_have_their_own_category():
    assert category("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "") == "collective"
    assert category("all-reduce-start", "all-reduce-start.3") == "collective"  # a CPU thunk
    assert category("loop_add_fusion", "add.7") == "fusion"


def test_read_events_can_keep_one_devices_plane():
    def plane(name, kernel):
        event = SimpleNamespace(name=kernel, start_ns=0.0, duration_ns=10.0, stats=[("hlo_module", "jit_step")])
        return SimpleNamespace(name=name, lines=[SimpleNamespace(name="Stream #13(compute)", events=[event])])

    profile = SimpleNamespace(planes=[plane("/device:GPU:0", "gemm_a"), plane("/device:GPU:1", "gemm_b")])
    assert {e.name for e in read_events(profile)[0]} == {"gemm_a", "gemm_b"}
    assert {e.name for e in read_events(profile, device=1)[0]} == {"gemm_b"}
