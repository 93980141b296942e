"""Lab 1's check: the check is the ring's network, and each rank a sandbox.

Three tiers: what a message may hold (no processes), the check on one file at a
given P (P sandboxed processes, in this process), and the command line as a
student runs it."""
import io
import os
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, mpi_env, run
from labs_fixtures import answers

from experiments.labs import ring_network
from experiments.labs.ring_network import Contents, Failed

FIXTURES = os.path.join(ROOT, "tests", "labs_fixtures")
SKELETON = os.path.join(ROOT, "experiments", "labs", "ring_skeleton.py")


def fixture(name):
    return os.path.join(FIXTURES, name)


def check(path, P):
    """The check's verdict on `path` at P: '' if right, else its lines (and any
    traceback) as one text."""
    out = io.StringIO()
    failed = ring_network.check(path, P, out)
    return "" if failed is None else "\n".join(failed.shown + failed.lines)


def check_ring(path, *args):
    return run([sys.executable, "-m", "experiments.labs.check_ring", path, *args], 200,
               mpi_env())


def honest_ring(c, P, n, chunk_of=None):
    """Feed Contents the messages of the textbook ring; returns the sums."""
    x = c.x.copy()
    bounds = [(a[0], a[-1] + 1) if len(a) else (0, 0)
              for a in np.array_split(np.arange(n), P)]
    for step in range(P - 1):
        sent = [x[r, slice(*bounds[(r - step - 1) % P])].copy() for r in range(P)]
        for r in range(P):
            c.take(r, sent[r], step + 1)
        for r in range(P):
            a, b = bounds[(r - step - 2) % P]
            x[r, a:b] += sent[(r - 1) % P]
    for step in range(P - 1):
        sent = [x[r, slice(*bounds[(r - step) % P])].copy() for r in range(P)]
        for r in range(P):
            c.take(r, sent[r], P + step)
        for r in range(P):
            a, b = bounds[(r - step - 1) % P]
            x[r, a:b] = sent[(r - 1) % P]
    c.finish()
    return x


# 1. what a message may hold: no processes

@pytest.mark.parametrize("P,n", [(2, 1), (3, 2), (3, 17), (4, 1001), (5, 7)])
def test_the_textbook_ring_sends_only_messages_a_ring_may_send(P, n):
    c = Contents(P, n, np.random.default_rng(P * 1000 + n))
    x = honest_ring(c, P, n)
    assert (x == c.total).all()


def test_the_inputs_differ_from_run_to_run_and_from_rank_to_rank():
    a = Contents(3, 100, np.random.default_rng())
    b = Contents(3, 100, np.random.default_rng())
    assert not np.array_equal(a.x, b.x)
    assert len(np.unique(a.x)) == a.x.size


def test_zeros_are_refused_as_padding():
    c = Contents(3, 30, np.random.default_rng(1))
    with pytest.raises(Failed, match="all 0.*padding"):
        c.take(0, np.zeros(10), 1)


def test_values_no_element_sums_to_are_refused():
    c = Contents(3, 30, np.random.default_rng(2))
    with pytest.raises(Failed, match="not any element of the inputs"):
        c.take(0, np.arange(10.0) + 1000, 1)


def test_a_partial_sum_without_the_senders_own_value_is_refused():
    """Passing on what arrived without adding one's own: not a ring's message."""
    c = Contents(3, 30, np.random.default_rng(3))
    with pytest.raises(Failed, match="without rank 1's own value"):
        c.take(1, c.x[0, :10].copy(), 1)


def test_more_than_a_chunk_is_refused():
    c = Contents(2, 10, np.random.default_rng(4))
    with pytest.raises(Failed, match="more than a chunk"):
        c.take(0, c.x[0].copy(), 1)


def test_the_same_partial_sum_twice_is_refused():
    c = Contents(3, 30, np.random.default_rng(5))
    c.take(0, c.x[0, :10].copy(), 1)
    with pytest.raises(Failed, match="went by summed over 1 ranks before"):
        c.take(0, c.x[0, 5:10].copy(), 2)


def test_elements_that_do_not_go_round_every_arc_are_named():
    c = Contents(3, 3, np.random.default_rng(6))
    with pytest.raises(Failed, match="element 0 went by as a partial sum over no ranks"):
        c.finish()


# 2. the check on one file at one P: sandboxed processes

def test_the_answer_key_passes_at_p_2_3_4(tmp_path):
    path = tmp_path / "my_ring.py"
    path.write_text(answers.ring())
    for P in (2, 3, 4):
        assert check(str(path), P) == "", P


def test_the_teachers_key_passes_at_p_2_3_4(tmp_path):
    """The five TODOs as the teacher's key writes them, filled into the skeleton."""
    key = open(os.path.join(ROOT, "experiments", "labs", "teacher", "01_answers.md")).read()
    block = key[key.index("## The five TODOs"):].split("```python\n")[1].split("```")[0]
    lines = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert len(lines) == len(answers.RING_TODOS) == 5
    path = tmp_path / "teacher_ring.py"
    filled = {todo: line + "\n" * todo.endswith("\n") for todo, line in zip(answers.RING_TODOS,
                                                                             lines)}
    path.write_text(answers.ring(filled))
    for P in (2, 3, 4):
        assert check(str(path), P) == "", P


def test_a_ring_with_its_own_chunks_numbering_and_segments_passes():
    for P in (2, 3, 4):
        assert check(fixture("ring_segmented_rotated.py"), P) == "", P


# The cheats that passed the check when ranks ran under mpiexec with the same
# inputs every run, and the reason the check gives each now.
CHEATS = {
    # a gather and a broadcast on the transport's own communicator, zeros for t
    "ring_cheat_transport_comm.py": "the lab's transport has no '_comm'",
    # the same on the world behind the check's wrapper (falls back to zeros alone)
    "ring_cheat_wrapped_world.py": "they are all 0",
    # the same on a world handle made with MPI.Comm.f2py
    "ring_cheat_f2py_world.py": "the lab's sandbox has no mpi4py",
    # no data moved: the sum worked out from the pattern the sheet documented
    "ring_cheat_oracle.py": "they are all 0",
    # an all-gather through files in /dev/shm
    "ring_cheat_shm_files.py": "no file may be written ('/dev/shm/",
}
OTHER_CHEATS = {
    "ring_cheat_pattern_messages.py": "not any element of the inputs summed over ranks",
    "ring_cheat_socket.py": "the lab's sandbox has no socket",
    "ring_cheat_unwritten_dump.py": "no file may be written",
    "ring_cheat_proc_peek.py": "is not readable here",
    "ring_mpi_allreduce.py": "the lab's sandbox has no mpi4py",
    "ring_padded_allreduce.py": "the lab's sandbox has no mpi4py",
}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_each_cheat_that_passed_before_is_refused_at_p_2_3_4(name):
    for P in (2, 3, 4):
        said = check(fixture(name), P)
        assert CHEATS[name] in said, f"P={P}: {said}"


def test_without_namespaces_the_audit_hook_alone_refuses_them(monkeypatch, tmp_path):
    """Where unshare is not allowed (no root, no user namespaces) the check runs each
    rank under the audit hook alone, and still refuses every way around t."""
    monkeypatch.setattr(ring_network, "_namespaces", [])
    assert "audit hook (this machine allows no namespaces)" in ring_network.sandbox_words()
    for name, reason in {"ring_cheat_shm_files.py": "no file may be written ('/dev/shm/",
                         "ring_cheat_proc_peek.py": "is not readable here",
                         "ring_cheat_f2py_world.py": "has no mpi4py"}.items():
        assert reason in check(fixture(name), 2), name
    path = tmp_path / "my_ring.py"
    path.write_text(answers.ring())
    assert check(str(path), 3) == ""


@pytest.mark.parametrize("name", sorted(OTHER_CHEATS))
def test_other_ways_around_t_are_refused(name):
    said = check(fixture(name), 3)
    assert OTHER_CHEATS[name] in said, said


NOT_RINGS = {
    ("ring_pairwise.py", 3): "in a ring rank",
    ("ring_whole_vectors.py", 2): "went by summed over 1 ranks before",
    ("ring_whole_vectors.py", 3): "went by summed over",
    ("ring_gather_to_root.py", 2): "more than a chunk",
    ("ring_gather_to_root.py", 4): "more than a chunk",
    ("ring_chain.py", 3): "more than the 2(P-1) chunks of a ring",
    ("ring_chunk_mismatch.py", 3): "the send and receive chunk sizes differ",
    ("ring_one_call_short.py", 3): "rank 0 waits in sendrecv call 4 for a message from rank 2, "
                                   "which returned from its ring after 3 sendrecv call(s)",
}


@pytest.mark.parametrize("name,P", sorted(NOT_RINGS))
def test_what_is_not_a_ring_is_refused_with_its_reason(name, P):
    said = check(fixture(name), P)
    assert NOT_RINGS[(name, P)] in said, said


def test_a_ring_that_forgets_to_add_is_named_at_its_first_message(tmp_path):
    path = tmp_path / "overwrites.py"
    path.write_text(answers.ring({"# TODO: add what arrived into our copy of recv_chunk":
                                  "x[r0:r1] = incoming[:r1 - r0]"}))
    said = check(str(path), 3)
    assert "without rank 2's own value: a ring adds what arrives from the left" in said, said


def test_a_missing_all_gather_is_caught_at_n_1_and_p_2(tmp_path):
    all_gather = "    for step in range(P - 1):\n        send_chunk = (r - step) % P"
    path = tmp_path / "no_allgather.py"
    path.write_text(answers.ring().replace(all_gather,
                                           all_gather.replace("range(P - 1)", "range(0)")))
    said = check(str(path), 2)
    assert "n=1: element 0's complete sum was sent 0 times" in said, said
    assert "(no all-gather?)" in said, said


def test_a_wrong_sum_on_one_rank_is_named(tmp_path):
    path = tmp_path / "one_rank_wrong.py"
    path.write_text(answers.ring().replace("    return x\n", "    if r == 1:\n"
                                           "        x[0] += 1\n    return x\n"))
    said = check(str(path), 3)
    assert "rank 1: wrong elements: 1, the first at index 0" in said, said


def test_a_rank_that_raises_shows_its_own_traceback_at_once():
    start = time.monotonic()
    said = check(fixture("ring_raises_on_one_rank.py"), 3)
    assert "rank 1, n=1: your ring raised IndexError: chunk index out of range" in said, said
    assert 'raise IndexError("chunk index out of range")' in said
    assert "ring_sandbox.py" not in said and "ring_transport.py" not in said, said
    assert time.monotonic() - start < 15


def test_a_rank_that_exits_is_named_with_its_exit_status():
    said = check(fixture("ring_exits.py"), 3)
    assert "rank 1 exited with status 3 (in its own code, before its first sendrecv call)" \
        in said, said


def test_sys_exit_in_the_ring_is_named(tmp_path):
    path = tmp_path / "exits_politely.py"
    path.write_text(answers.ring().replace("    return x\n", "    if r == 2:\n"
                                           "        raise SystemExit(4)\n    return x\n"))
    assert "rank 2, n=1: exited with status 4 (sys.exit) inside the ring" in check(str(path), 3)


@pytest.mark.timeout(60)
def test_a_rank_that_hangs_is_named_with_its_line_within_30_s_at_p_2():
    start = time.monotonic()
    said = check(fixture("ring_hangs.py"), 2)
    elapsed = time.monotonic() - start
    assert "rank 1 has run its own code for 10 s before its first sendrecv call" in said, said
    # the loop is two lines, and the sample catches it at either
    assert "line 8 of your file (in ring_allreduce): `while r == 1:`" in said or \
        "line 9 of your file (in ring_allreduce): `pass`" in said, said
    assert "rank 0 waits in sendrecv call 1 for a message from rank 1" in said, said
    assert elapsed < 30, elapsed


def test_a_file_without_ring_allreduce_is_named(tmp_path):
    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    assert "defines no ring_allreduce(t, x)" in check(str(path), 2)


# 3. the command line, as the sheet runs it

@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_check_ring_passes_the_answer_and_times_it(tmp_path):
    path = tmp_path / "my_ring.py"
    path.write_text(answers.ring())
    result = check_ring(str(path), "--np", "2,3")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "each rank runs in a sandbox" in out
    assert "P=2: correct" in out and "P=3: correct" in out and "PASS" in out
    assert "cost model (probed now: no cores term)" in out and "of the prediction" in out


@pytest.mark.timeout(60)
def test_the_untouched_skeleton_fails_with_its_traceback():
    result = check_ring(SKELETON, "--np", "2", "--no-timing")
    assert result.returncode == 1
    out = result.stdout
    assert "P=2: WRONG" in out and "FAIL" in out and "raised TypeError" in out, out
    assert out.index("Traceback") < out.index("P=2: WRONG"), out


@pytest.mark.timeout(60)
def test_what_a_rank_prints_is_shown_with_its_rank(tmp_path):
    path = tmp_path / "chatty.py"
    path.write_text(answers.ring().replace("    return x\n",
                                           "    print('hello from', r, flush=True)\n"
                                           "    return x\n"))
    result = check_ring(str(path), "--np", "2", "--no-timing")
    assert result.returncode == 0, result.stdout
    assert "rank 1| hello from 1" in result.stdout
