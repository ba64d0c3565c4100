"""The order pytest-xdist hands test files to its workers under `--dist loadfile` (`make test`):
the slowest files first, then the rest in xdist's own order.

xdist queues the files with the most tests first, so files of a few long tests (the tensor-parallel
subprocesses, the notebooks, the schema corpus) come last, and one worker runs them alone while the
other has finished. Longest first keeps both workers busy until the short files at the end.
"""

import pytest

# The files that take longest on two CPU cores (pytest --durations=0 summed per file, empty compilation cache),
# slowest first. A file not listed still runs, after these, in xdist's order.
SLOW_FILES = (
    "tests/proposers/test_suffix.py",
    "tests/engine/test_rejection.py",
    "tests/engine/test_speculative.py",
    "tests/engine/test_batch_invariant_moe.py",
    "tests/engine/test_structured.py",
    "tests/e2e/test_head_copies.py",
    "tests/e2e/test_notebooks.py",
    "tests/e2e/test_tensor_parallel.py",
    "tests/proposers/test_sliding_drafters.py",
    "tests/engine/test_batch_invariant.py",
    "tests/api/test_vllm_compat.py",
    "tests/api/test_server.py",
    "tests/engine/test_prefix_caching.py",
    "tests/models/test_layer_scan.py",
    "tests/proposers/test_draft_model.py",
    "tests/engine/test_schema_corpus.py",
    "tests/loading/test_random_drafters.py",
    "tests/e2e/test_default_trained.py",
    "tests/api/test_server_structured.py",
    "tests/kernels/test_pallas_gdn.py",
    "tests/proposers/test_dspark_draft_vocab.py",
    "tests/loading/test_quantized_checkpoints.py",
    "tests/api/test_vllm_examples.py",
    "tests/kernels/test_quant_matmul.py",
    "tests/api/test_agent_loop.py",
    "tests/e2e/test_wheel.py",
    "tests/api/test_reasoning_structured.py",
    "tests/proposers/test_dspark.py",
    "tests/kernels/test_flash_attention.py",
    "tests/proposers/test_combined.py",
    "tests/proposers/test_eagle3.py",
    "tests/api/test_cli_and_default.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under --dist loadfile, xdist's file scheduling with `SLOW_FILES` taken first; otherwise
    xdist's own scheduler."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SlowFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            queued = [scope for scope in SLOW_FILES if scope in self.workqueue]
            if queued:
                self.workqueue.move_to_end(queued[0], last=False)
            super()._assign_work_unit(node)

    return SlowFilesFirst(config, log)
