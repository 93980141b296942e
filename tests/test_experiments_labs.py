"""The labs' self-check scripts: they accept right answers, reject wrong ones with a
reason, and never print the expected figures of a pen-and-paper answer."""
import os
import sys
import time

import pytest
from conftest import ROOT, mpi_env, run
from labs_fixtures import answers

from experiments.labs import check_answers

SKELETON = os.path.join(ROOT, "experiments", "labs", "ring_skeleton.py")
FIXTURES = os.path.join(ROOT, "tests", "labs_fixtures")


def student_file(tmp_path, replacements=None, name="my_ring.py"):
    path = tmp_path / name
    path.write_text(answers.ring(replacements))
    return str(path)


def check_ring(path, *args):
    return run([sys.executable, "-m", "experiments.labs.check_ring", path, *args], 200,
               mpi_env())


def fails(result, P, *reasons):
    """check_ring said WRONG at P for one of `reasons`, and FAIL at the end."""
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert f"P={P}: WRONG" in out and "FAIL" in out, out
    assert any(reason in out for reason in reasons), out
    assert "MPI_Abort" not in result.stderr and "Traceback" not in out + result.stderr, \
        result.stderr


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_check_ring_accepts_a_right_ring_and_times_it(tmp_path):
    result = check_ring(student_file(tmp_path), "--np", "2,3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "P=2: correct" in result.stdout and "P=3: correct" in result.stdout
    assert "cost model (probed now" in result.stdout and "of the prediction" in result.stdout
    assert "PASS" in result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_check_ring_rejects_a_ring_that_forgets_to_add(tmp_path):
    broken = {"# TODO: add what arrived into our copy of recv_chunk":
              "x[r0:r1] = incoming[:r1 - r0]     # overwrites instead of adding"}
    result = check_ring(student_file(tmp_path, broken), "--np", "3", "--no-timing")
    fails(result, 3, "never added theirs")
    assert "the first at index" in result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_a_missing_all_gather_is_caught_at_n_1_and_p_2(tmp_path):
    """Rank 0 used to add 0 at index 0 (arange + 1000 rank), so this ring passed n=1, P=2."""
    text = answers.ring().replace("    for step in range(P - 1):\n        send_chunk = (r - step) % P",
                                  "    for step in range(0):\n        send_chunk = (r - step) % P")
    path = tmp_path / "no_allgather.py"
    path.write_text(text)
    result = check_ring(str(path), "--np", "2", "--no-timing")
    fails(result, 2, "n=1: wrong elements")


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_check_ring_rejects_whole_vectors_by_their_bytes():
    """Right sums, (P-1) n bytes per rank: the same as a ring's at P = 2, more at P = 3."""
    result = check_ring(os.path.join(FIXTURES, "ring_whole_vectors.py"), "--np", "3",
                        "--no-timing")
    fails(result, 3, "are whole vectors going round the ring?")


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_check_ring_rejects_a_direct_mpi_allreduce():
    result = check_ring(os.path.join(FIXTURES, "ring_mpi_allreduce.py"), "--np", "2",
                        "--no-timing")
    fails(result, 2, "the ranks sent 0 bytes through t")
    assert "MPI_Allreduce" in result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_check_ring_names_a_chunk_size_mismatch():
    """Not MPI's truncation error: the sizes on both sides, in the lab's words."""
    result = check_ring(os.path.join(FIXTURES, "ring_chunk_mismatch.py"), "--np", "3",
                        "--no-timing")
    fails(result, 3, "the send and receive chunk sizes differ")
    assert "truncat" not in (result.stdout + result.stderr).lower()


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_ranks_agree_on_the_verdict_of_each_length(tmp_path):
    """One rank wrong at the first length: every rank stops there at once, without
    waiting for the others in the next length."""
    path = tmp_path / "one_rank_wrong.py"
    path.write_text(answers.ring().replace("    return x\n", "    if r == 1:\n"
                                           "        x[0] += 1\n    return x\n"))
    start = time.monotonic()
    result = check_ring(str(path), "--np", "3", "--no-timing")
    fails(result, 3, "rank 1, n=1: wrong elements")
    assert "found no partner" not in result.stdout and "rank 0" not in result.stdout
    assert time.monotonic() - start < 60


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_a_rank_that_raises_is_the_cause_and_the_others_only_waited():
    result = check_ring(os.path.join(FIXTURES, "ring_raises_on_one_rank.py"), "--np", "2",
                        "--no-timing")
    fails(result, 2, "rank 1, n=1: raised IndexError")
    assert "rank(s) 0 then waited for it in vain" in result.stdout
    assert "found no partner" not in result.stdout


@pytest.mark.timeout(60)
def test_the_untouched_skeleton_fails():
    result = check_ring(SKELETON, "--np", "2", "--no-timing")
    fails(result, 2, "raised TypeError")


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
