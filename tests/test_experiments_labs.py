"""The labs' self-check scripts: they accept the reference answers and reject wrong ones."""
import os
import sys

import pytest
from conftest import ROOT, mpi_env, run

from experiments.labs import check_answers

SKELETON = os.path.join(ROOT, "experiments", "labs", "ring_skeleton.py")

# The four TODOs of ring_skeleton.py, filled in as allreduce/ring.py does it.
REFERENCE = {
    "send_chunk = None      # TODO: which chunk goes right at this step?":
        "send_chunk = (r - step - 1) % P",
    "recv_chunk = None      # TODO: which chunk arrives from the left?":
        "recv_chunk = (r - step - 2) % P",
    "# TODO: add what arrived into our copy of recv_chunk": "x[r0:r1] += incoming[:r1 - r0]",
    "send_chunk = None      # TODO: the chunk this rank completed most recently":
        "send_chunk = (r - step) % P",
    "recv_chunk = None      # TODO\n": "recv_chunk = (r - step - 1) % P\n",
}


def student_file(tmp_path, replacements, name):
    text = open(SKELETON).read()
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def check_ring(path, *args):
    return run([sys.executable, "-m", "experiments.labs.check_ring", path, *args], 200,
               mpi_env())


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_check_ring_accepts_the_reference_ring_and_times_it(tmp_path):
    result = check_ring(student_file(tmp_path, REFERENCE, "ring_ok.py"), "--np", "2,3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "P=2: correct" in result.stdout and "P=3: correct" in result.stdout
    assert "cost model predicts" in result.stdout and "of the prediction" in result.stdout
    assert "PASS" in result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_check_ring_rejects_a_ring_that_forgets_to_add(tmp_path):
    broken = dict(REFERENCE)
    broken["# TODO: add what arrived into our copy of recv_chunk"] = \
        "x[r0:r1] = incoming[:r1 - r0]     # overwrites instead of adding"
    result = check_ring(student_file(tmp_path, broken, "ring_bad.py"), "--np", "3",
                        "--no-timing")
    assert result.returncode == 1
    assert "P=3: WRONG" in result.stdout and "first at index" in result.stdout
    assert "FAIL" in result.stdout


@pytest.mark.timeout(30)
def test_the_untouched_skeleton_fails(tmp_path):
    result = check_ring(SKELETON, "--np", "2", "--no-timing")
    assert result.returncode == 1 and "WRONG" in result.stdout


@pytest.mark.timeout(30)
def test_check_answers(tmp_path, capsys):
    zero = tmp_path / "zero.toml"
    zero.write_text("params = 1_000_000\nranks = 4\nstage0 = 16e6\nstage1 = 10e6\n"
                    "stage2 = 7e6\nstage3 = 4e6\n")
    assert check_answers.main(["zero", str(zero)]) == 0
    zero.write_text("params = 1_000_000\nranks = 4\nstage0 = 16e6\nstage1 = 8e6\n"
                    "stage2 = 7e6\nstage3 = 4e6\n")
    assert check_answers.main(["zero", str(zero)]) == 1
    assert "WRONG stage1" in capsys.readouterr().out
    pipe = tmp_path / "pipe.toml"
    pipe.write_text("stages = 4\n[bubble]\nm1 = 0.75\nm8 = 0.2727\n"
                    "[in_flight_first_stage]\ngpipe_m8 = 8\n1f1b_m8 = 4\n")
    assert check_answers.main(["pipeline", str(pipe)]) == 0
    pipe.write_text("stages = 4\n[in_flight_first_stage]\n1f1b_m8 = 8\n")
    assert check_answers.main(["pipeline", str(pipe)]) == 1
    grid = tmp_path / "grid.py"
    grid.write_text("def coords_of(rank, dp, pp, tp):\n"
                    "    return rank // (pp * tp), (rank // tp) % pp, rank % tp\n")
    assert check_answers.main(["grid", str(grid)]) == 0
    grid.write_text("def coords_of(rank, dp, pp, tp):\n"          # dp fastest: wrong layout
                    "    return rank % dp, (rank // dp) % pp, rank // (dp * pp)\n")
    assert check_answers.main(["grid", str(grid)]) == 1
    skeleton = os.path.join(ROOT, "experiments", "labs", "grid_skeleton.py")
    assert check_answers.main(["grid", skeleton]) == 1
