"""The labs' self-check scripts: they accept right answers, reject wrong ones with a
reason, and never print the expected figures of a pen-and-paper answer."""
import os
import re
import sys
import time

import pytest
from conftest import ROOT, mpi_env, run
from labs_fixtures import answers

from experiments import shm_segments
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


def fails(result, P, *reasons, traceback=False):
    """check_ring said WRONG at P for one of `reasons`, and FAIL at the end; no MPI
    noise, and no traceback unless the student's ring raised one."""
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert f"P={P}: WRONG" in out and "FAIL" in out, out
    assert any(reason in out for reason in reasons), out
    assert "MPI_Abort" not in result.stderr and "BAD TERMINATION" not in out + result.stderr, \
        result.stderr
    assert ("Traceback" in out + result.stderr) == traceback, out + result.stderr


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_check_ring_accepts_a_right_ring_and_times_it(tmp_path):
    result = check_ring(student_file(tmp_path), "--np", "2,3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "P=2: correct" in result.stdout and "P=3: correct" in result.stdout
    assert "cost model (probed now: no cores term)" in result.stdout and "of the prediction" in result.stdout
    assert "PASS" in result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_check_ring_rejects_a_ring_that_forgets_to_add(tmp_path):
    broken = {"# TODO: add what arrived into our copy of recv_chunk":
              "x[r0:r1] = incoming[:r1 - r0]     # overwrites instead of adding"}
    segments = shm_segments.snapshot()
    result = check_ring(student_file(tmp_path, broken), "--np", "3", "--no-timing")
    fails(result, 3, "never added theirs")
    assert "the first at index" in result.stdout
    # the wrong ring ended in MPI_Abort; the check removed the segment MPICH left (one
    # that a live process maps is another job's, still running, and not a leak)
    left = shm_segments.snapshot() - segments - shm_segments.mapped()
    assert not left, left


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_a_missing_all_gather_is_caught_at_n_1_and_p_2(tmp_path):
    """Rank 0 used to add 0 at index 0 (arange + 1000 rank), so this ring passed n=1, P=2."""
    all_gather = "    for step in range(P - 1):\n        send_chunk = (r - step) % P"
    text = answers.ring().replace(all_gather, all_gather.replace("range(P - 1)", "range(0)"))
    path = tmp_path / "no_allgather.py"
    path.write_text(text)
    result = check_ring(str(path), "--np", "2", "--no-timing")
    fails(result, 2, "n=1: wrong elements")


# Right sums, and a ring's bytes at some P (the padded all-reduce at every P, the
# pairwise exchange at every P, the last two at P = 2): each must fail at every P
# it is run at, for the reason given.
NOT_RINGS = {
    "ring_padded_allreduce.py": "called MPI.COMM_WORLD.Allreduce",
    "ring_pairwise.py": "in a ring rank",
    "ring_whole_vectors.py": "never whole vectors",
    "ring_gather_to_root.py": "never whole vectors",
}


@pytest.mark.mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fixture", sorted(NOT_RINGS))
def test_check_ring_refuses_what_is_not_a_ring_at_p_3_and_4(fixture):
    """The ring's own shape: exchanges with the neighbours only, chunks not vectors,
    and nothing on MPI.COMM_WORLD (an Allreduce, then zeros sent round to make up
    a ring's byte count, used to pass)."""
    result = check_ring(os.path.join(FIXTURES, fixture), "--np", "3,4", "--no-timing")
    fails(result, 4, NOT_RINGS[fixture])
    at_3, at_4 = result.stdout.split("P=3: ")[1].split("P=4: ")
    assert at_3.startswith("WRONG") and NOT_RINGS[fixture] in at_3, result.stdout
    assert NOT_RINGS[fixture] in at_4, result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fixture", ["ring_whole_vectors.py", "ring_gather_to_root.py"])
def test_check_ring_refuses_them_at_p_2_too(fixture):
    """At P = 2 whole vectors and a gather to rank 0 send a ring's bytes: their
    messages' length gives them away."""
    result = check_ring(os.path.join(FIXTURES, fixture), "--np", "2", "--no-timing")
    fails(result, 2, NOT_RINGS[fixture])


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
def test_a_rank_that_raises_shows_its_traceback_and_the_others_stop_at_once():
    """The raising rank tells the others, which stop waiting for it: the whole check
    ends well before one sendrecv's timeout (a correctness bound, generous on
    purpose: it took 10 s a P before)."""
    from experiments.labs.ring_transport import TIMEOUT_S
    start = time.monotonic()
    result = check_ring(os.path.join(FIXTURES, "ring_raises_on_one_rank.py"), "--np", "3",
                        "--no-timing")
    elapsed = time.monotonic() - start
    fails(result, 3, "rank 1, n=1: raised IndexError", traceback=True)
    out = result.stdout
    assert 'raise IndexError("chunk index out of range")' in out, out
    assert out.index("Traceback") < out.index("P=3: WRONG"), out
    assert "rank(s) 0, 2 were waiting for it, and stopped" in out
    assert "found no partner" not in out and "check_ring.py" not in out, out
    assert elapsed < TIMEOUT_S, f"{elapsed:.1f} s: the others waited for the timeout"


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_a_rank_that_exits_is_named_with_its_exit_status():
    """os._exit(3) on rank 1: MPI alone would report another rank's SIGKILL."""
    result = check_ring(os.path.join(FIXTURES, "ring_exits.py"), "--np", "3", "--no-timing")
    fails(result, 3, "rank 1 exited with status 3 at n=1")


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_sys_exit_in_the_ring_is_named(tmp_path):
    path = tmp_path / "exits_politely.py"
    path.write_text(answers.ring().replace("    return x\n", "    if r == 2:\n"
                                           "        raise SystemExit(4)\n    return x\n"))
    result = check_ring(str(path), "--np", "3", "--no-timing")
    fails(result, 3, "rank 2, n=1: exited with status 4 (sys.exit) inside the ring")


@pytest.mark.timeout(60)
def test_the_untouched_skeleton_fails():
    result = check_ring(SKELETON, "--np", "2", "--no-timing")
    fails(result, 2, "raised TypeError", traceback=True)


def answer(tmp_path, capsys, main, lab, text, name):
    """(exit status, output) of a self-check on `text`."""
    path = tmp_path / name
    path.write_text(text)
    status = main([lab, str(path)] if lab else [str(path)])
    return status, capsys.readouterr().out


def figures(text):
    """The numbers a text prints, as floats (10_000_000, 1e7 and 10000000.0 alike),
    leaving out digits inside names (m4, 1f1b_m8)."""
    number = r"(?<![\w.])\d[\d_]*\.?\d*(?:e[+-]?\d+)?(?!\w)"
    return {float(x.replace("_", "")) for x in re.findall(number, text)}


@pytest.mark.timeout(30)
def test_check_answers_zero_grades_without_giving_the_figures_away(tmp_path, capsys):
    def check(text):
        return answer(tmp_path, capsys, check_answers.main, "zero", text, "my_zero.toml")
    assert check(answers.ZERO)[0] == 0
    status, out = check(answers.ZERO.replace("stage1 = 10_000_000", "stage1 = 8_000_000")
                        .replace("stage3 = 4_000_000", "stage3 = 0"))
    assert status == 1 and "WRONG stage1: yours 8000000" in out and "WRONG stage3" in out
    assert "ok    stage2" in out
    assert not figures(out) & {10e6, 4e6}, out        # the right figures of the wrong answers
    # a stage answered part by part: the wrong part is named, its figure is not given
    parts = "[stage2]\nparams = 4e6\ngrads = 4e6\noptimizer = 2e6\n"
    status, out = check(answers.ZERO.replace("stage2 = 7_000_000\n", "") + parts)
    assert status == 1 and "FAIL: 1 wrong" in out
    assert "ok    stage2.params" in out and "ok    stage2.optimizer" in out
    assert "WRONG stage2.grads: yours 4000000" in out and 1e6 not in figures(out), out


@pytest.mark.timeout(30)
def test_check_answers_precision_grades_mixed_precision_and_momentum(tmp_path, capsys):
    def check(text):
        return answer(tmp_path, capsys, check_answers.main, "precision", text,
                      "my_precision.toml")
    assert check(answers.PRECISION)[0] == 0
    # the fp32 answers (lab 3's) are wrong here, and the right figures are not shown
    status, out = check(answers.PRECISION.replace("stage1 = 7_000_000", "stage1 = 10_000_000")
                        .replace("momentum_stage0 = 12_000_000", "momentum_stage0 = 8e6"))
    assert status == 1 and "WRONG stage1: yours 10000000" in out
    assert "WRONG momentum_stage0" in out and "ok    stage2" in out
    assert not figures(out) & {7e6, 12e6}, out


@pytest.mark.timeout(30)
def test_check_answers_pipeline_grades_without_giving_the_figures_away(tmp_path, capsys):
    def check(text):
        return answer(tmp_path, capsys, check_answers.main, "pipeline", text, "my_pipe.toml")
    assert check(answers.PIPELINE)[0] == 0
    status, out = check(answers.PIPELINE.replace("m4 = 0.4286", "m4 = 0.5")
                        .replace("1f1b_m8 = 4", "1f1b_m8 = 8"))
    assert status == 1 and "WRONG bubble.m4: yours 0.5" in out
    assert "WRONG in_flight_first_stage.1f1b_m8" in out
    assert not figures(out) & {0.4286, 0.428571, 4.0} and "0.42" not in out, out


@pytest.mark.timeout(30)
def test_check_answers_grid_names_the_wrong_coordinate_not_its_value(tmp_path, capsys):
    def check(text):
        return answer(tmp_path, capsys, check_answers.main, "grid", text, "my_grid.py")
    status, out = check(answers.GRID)
    assert status == 0 and "PASS" in out and "group_of" not in out
    dp_fastest = ("def coords_of(rank, dp, pp, tp):\n"
                  "    return rank % dp, (rank // dp) % pp, rank // (dp * pp)\n")
    status, out = check(dp_fastest)
    assert status == 1 and "wrong)" in out and "expected" not in out
    status, out = check(answers.GRID.replace("return [(i * pp + p) * tp + t for i in range(dp)]",
                                             "return [rank]"))
    assert status == 1 and "WRONG group_of(" in out and "'dp'" in out
    skeleton = os.path.join(ROOT, "experiments", "labs", "grid_skeleton.py")
    assert check_answers.main(["grid", skeleton]) == 1


@pytest.mark.timeout(30)
def test_check_ps_grades_the_predictions_without_giving_them_away(tmp_path, capsys):
    from experiments.labs import check_ps

    def check(text):
        return answer(tmp_path, capsys, check_ps.main, None, text, "my_ps.toml")
    status, out = check(answers.PS)
    assert status == 0 and out.count("ok ") == 5 and "PASS" in out
    # the server's bytes taken for a worker's, staleness counted in steps of s
    wrong = (answers.PS.replace("ps_server = 8_000_000", "ps_server = 4_000_000")
             .replace("ssp_straggler = 1", "ssp_straggler = 3"))
    status, out = check(wrong)
    assert status == 1 and "FAIL: 2 wrong" in out
    assert "WRONG bytes_per_step.ps_server: yours 4000000" in out
    assert "WRONG staleness.ssp_straggler: yours 3" in out
    assert not figures(out) & {8e6, 1.0}, out
    status, out = check(answers.PS.replace("ring_rank = 5_333_333\n", ""))
    assert status == 1 and "WRONG bytes_per_step.ring_rank: yours missing" in out
