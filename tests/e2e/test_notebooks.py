"""The notebooks run top to bottom without a cell error, each in a fresh kernel of this interpreter.

The kernelspec is written to a temporary folder, so a fresh `.venv` with no Jupyter kernel
installed works. Each notebook has a wall-clock budget: every cell gets what is left of it.
"""

import os
import time

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from helpers import ROOT

NOTEBOOKS = ROOT / "notebooks"
# Seconds per notebook, about 5x what each takes on 2 idle CPU cores with an empty compilation cache
# (24, 26 and 17 s; the acceptance study gets more, as a trained default adds two drafters). The
# quickstart runs first: the others reuse its executables through the persistent compilation cache,
# as they use its shapes (max_model_len 128, batches of two; also test_default_trained's, whose
# executables they reuse when the trained default ships).
BUDGET_S = {"quickstart": 120, "acceptance_study": 240, "kernels_walkthrough": 90}
# A smaller setting of a notebook's cells, run here after its cell tagged "parameters" (papermill's
# convention): the acceptance study measures one k per method, the programs the quickstart compiled
# (each deeper k compiles another).
SMALLER = {"acceptance_study": "NGRAM_KS, MTP_KS = (3,), (2,)"}


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory) -> KernelSpecManager:
    folder = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(folder / "spec_jax")  # argv: this interpreter -m ipykernel_launcher
    return KernelSpecManager(kernel_dirs=[str(folder)])


def kernel_env() -> dict:
    """The test's environment (JAX on CPU, the shared compilation cache), the repo importable
    from the notebooks' folder, and matplotlib without a display."""
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "MPLBACKEND": "Agg"}


@pytest.mark.parametrize("name", list(BUDGET_S))
def test_notebook_runs_without_error(name, kernel_specs):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), f"{name}.ipynb is committed with outputs"
    if name in SMALLER:
        (at,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(SMALLER[name]))
    deadline = time.monotonic() + BUDGET_S[name]
    client = NotebookClient(nb, km=AsyncKernelManager(kernel_name="spec_jax", kernel_spec_manager=kernel_specs),
                            timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    # raises CellExecutionError at the first failing cell; cleanup_kc: the kernel is ours to stop (a
    # client given a manager leaves its kernel, with its JAX programs, alive until the worker exits)
    client.execute(env=kernel_env(), cleanup_kc=True)
    assert all(c.execution_count for c in code)
