"""The package as users install it: a wheel built from the tree, installed in a fresh virtualenv,
runs `make demo`'s generate command from the installed package (its default model and drafters
are package data). The new virtualenv borrows the test interpreter's dependencies through a path
file, so nothing is downloaded; the editable install of this tree is not among them (its import
hook is a path file, which only site directories run)."""

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from helpers import ROOT

PACKAGED = ("pyproject.toml", "README.md", "spec_jax", "models", "proposers", "pallas_kernels")
MAKEFILE_DEMO = "generate --prompt"  # the demo's command line in the Makefile starts `spec-jax generate`


def demo_arguments() -> list[str]:
    """The arguments `make demo` passes to spec-jax, read from the Makefile."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "spec-jax " + MAKEFILE_DEMO in line)
    return shlex.split(line.split("spec-jax ", 1)[1])


def test_the_wheel_runs_the_demo_from_its_install(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what the install brings
    source, wheel_dir, venv = tmp_path / "source", tmp_path / "wheel", tmp_path / "venv"
    source.mkdir()
    for name in PACKAGED:  # a copy: a build in the tree would reuse what an earlier one left in build/
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheel_dir), str(source)], check=True, cwd=tmp_path, env=env)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    (wheel,) = wheel_dir.glob("spec_jax-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, env=env)
    installed = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    check=True, capture_output=True, text=True, env=env).stdout.strip())
    # The dependencies, after the install: pip never sees this tree's editable install beside it.
    (installed / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run([python, "-c", "import spec_jax; print(spec_jax.__file__)"], check=True,
                           capture_output=True, text=True, cwd=tmp_path, env=env).stdout
    assert where.startswith(str(installed)), where
    # From the install's own folder, as `make demo` runs from the tree's: the drafter path is relative.
    run = subprocess.run([venv / "bin" / "spec-jax", *demo_arguments()], cwd=installed, capture_output=True,
                         text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "speculation on" in run.stdout, run.stdout[-2000:]
