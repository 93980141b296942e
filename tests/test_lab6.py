"""Lab 6: its self-check (experiments/labs/check_cluster.py) accepts right answers and
rejects wrong ones without giving the expected figures away (pure: no cluster, no MPI);
its sheet's commands run as written, as root (skipped without, as tests/cluster/ are);
the simulator prints what its question 7 reads."""
import os
import re

import pytest
from conftest import ROOT

from allreduce.units import parse_size
from experiments.labs import check_cluster
from labs_fixtures import answers
from labs_fixtures.sheets import SKIP, run_sheet, sheet_commands, student_shell

SHEET = os.path.join(ROOT, "experiments", "labs", "06_cluster_topologies.md")
# The sheet's cluster, under names and addresses of the test's own, so that a cluster
# someone brought up by hand (the default tl- prefix) is never touched.
PREFIX, SUBNET = "tlk-", "10.77.43.0/24"

N, MS = answers.N, answers.MS

RIGHT = answers.CLUSTER


def check(tmp_path, capsys, text):
    path = tmp_path / "my_cluster.toml"
    path.write_text(text)
    code = check_cluster.main([str(path)])
    return code, capsys.readouterr().out


@pytest.mark.timeout(10)
def test_right_answers_pass(tmp_path, capsys):
    code, out = check(tmp_path, capsys, RIGHT)
    assert code == 0 and out.strip().endswith("PASS"), out
    assert out.count("ok ") == 13


@pytest.mark.timeout(10)
@pytest.mark.parametrize("old, new, right", [
    (f"ring = {1.5 * N:.0f}\ntree = {N}", f"ring = {2 * N}\ntree = {N}",      # forgot (P-1)/P
     f"{1.5 * N:.0f}"),
    (f"hierarchical = {N}\n[2x2.link_ms]", f"hierarchical = {2 * N}\n[2x2.link_ms]", f"{N}"),
    (f"tree = {2 * MS:.1f}", f"tree = {MS:.1f}", f"{2 * MS:.1f}"),     # bytes / rate: one way
    (f"[4x1]\nring = {1.5 * N:.0f}\ntree = {2 * N}", f"[4x1]\nring = {1.5 * N:.0f}\ntree = {N}",
     f"{2 * N}"),
])
def test_a_wrong_answer_fails_and_is_not_corrected(tmp_path, capsys, old, new, right):
    assert old in RIGHT
    code, out = check(tmp_path, capsys, RIGHT.replace(old, new, 1))
    assert code == 1 and "FAIL: 1 of 13 wrong" in out, out
    wrong = [line for line in out.splitlines() if line.startswith("WRONG")]
    assert len(wrong) == 1 and right not in wrong[0], wrong
    assert "expected" not in out.lower()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text, message", [
    ("gbps = 1\n[2x2]\nring = 1\n", "bytes = N"),
    (f"bytes = {N}\ngbps = 1\n", "no layout"),
    (f"bytes = {N}\ngbps = 1\n[2by2]\nring = 1\n", "not a layout"),
    (f"bytes = {N}\ngbps = 1\n[2x2]\nrings = 1\n", "not one of"),
])
def test_a_malformed_file_is_refused_with_the_reason(tmp_path, capsys, text, message):
    code, out = check(tmp_path, capsys, text)
    assert code == 2 and message in out, out


@pytest.mark.timeout(30)
def test_the_simulator_prints_a_row_per_size_asked_for(capsys):
    """Lab 6's question 7 reads hierarchical / ring at 16 MiB per number of hosts."""
    from experiments import simulate
    rows, _ = simulate.main(["--ranks-per-node", "2", "--sizes", "16M,64K", "--ranks", "4,8,64"])
    out = capsys.readouterr().out
    table = out.split("below 1: faster than the ring)\n")[1].splitlines()
    header, lines = table[0].split(), [line.split() for line in table[1:]]
    assert [(line[0], line[2]) for line in lines] == [
        (P, size) for P in ("4", "8", "64") for size in ("16M", "64K")]
    hierarchical = header.index("hierarchical") - 1         # the "|" column has no header
    for line in lines:
        P, n = int(line[0]), parse_size(line[2])
        time = {r["algo"]: r["time_s"] for r in rows if r["P"] == P and r["bytes"] == n}
        assert float(line[3]) == pytest.approx(time["ring"] * 1e3, abs=1e-3)
        assert float(line[hierarchical]) == pytest.approx(
            time["hierarchical"] / time["ring"], abs=1e-3)


@pytest.mark.timeout(10)
def test_a_crossover_holds_from_there_on():
    """A win at a few sizes, lost again further on, is no crossover."""
    from experiments.simulate import won_until
    sizes = [1, 2, 4, 8]
    assert won_until(sizes, [True, True, False, True]) == 2
    assert won_until(sizes[::-1], [True, False, True, True]) == 8
    assert won_until(sizes, [False, True, True, True]) is None


def own_cluster(command):
    """The command with the test's --prefix (and --subnet, where it takes one)."""
    command = re.sub(r"(experiments\.cluster (up|run))\b", rf"\1 --prefix {PREFIX} --subnet {SUBNET}",
                     command)
    return command.replace("experiments.cluster down", f"experiments.cluster down --prefix {PREFIX}")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_sheets_commands_run_as_written_as_root(namespaces, tmp_path):
    """What runs in seconds: the pen-and-paper check, SUDO=... (empty for root, where
    `sudo` may not exist), and the cluster's up and down through $SUDO.  The benches
    and calibrations ([long]) are tests/cluster/'s."""
    root, env = student_shell(tmp_path)
    env["TOPOLAB_CLUSTER_DIR"] = str(tmp_path / "cluster")
    commands = [own_cluster(c) for c in sheet_commands(SHEET) if not SKIP.search(c)]
    assert any("$SUDO" in c and " up " in c for c in commands), commands
    try:
        print("\n".join(run_sheet(commands, root, env, os.path.basename(SHEET))))
    finally:
        run_sheet([own_cluster("SUDO= ; .venv/bin/python -m experiments.cluster down")], root,
                  env, "clean-up")
