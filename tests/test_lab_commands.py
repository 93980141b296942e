"""The lab sheets' commands run as written, from the repository root, without
activating the venv.

Each fenced ```bash block of experiments/labs/NN_*.md but lab 6's (which needs
root: test_lab6.py) is cut into commands (a
line continued by a backslash, a heredoc and a for-loop are one command each), and
the commands of a sheet run in order with bash, in a scratch copy of the repository
root (its entries linked, a `results/` of its own), with the venv's bin directory
taken off PATH, as in a student's shell where nobody typed `source .venv/bin/activate`.
Where a sheet has the student write a file (my_ring.py, my_zero.toml, ...), the test
puts the right answer there (tests/labs_fixtures/answers.py) before the next command,
so every self-check must end in PASS; a variable a sheet sets is set for the commands
after it (tests/labs_fixtures/sheets.py).

Not run, by the comment a sheet puts on them (about 5 minutes on 2 cores in all):
  # [long: ...]   a minute or more on 2 shared cores: lab 1's calibration, lab 2's
                  sweep, lab 3's ZeRO bench and its four training runs, lab 4's
                  pipeline bench, lab 5's 4-rank grid run, lab 8's six training runs,
                  lab 10's sweep of eight
  # [after ...]   reads what a [long] command wrote (lab 1's check against the
                  calibration, lab 2's report and run check, lab 3's memory table,
                  lab 8's and lab 10's tables and figures)
A command whose comment says `exits N` must exit with status N (lab 5's refusals,
lab 10's Ulysses on 3 heads).
Those commands' tools are covered elsewhere: the sweep, report and check_ps on
records by test_experiments_report.py, the benches and grid runs by
test_parallel_runs.py; lab 10's sweep and what reads it by
tests/test_lab_key_context.py.  Every command, run or not, is linted for the venv's tools.
"""
import glob
import os
import re
import subprocess

import pytest
from conftest import ROOT
from labs_fixtures.sheets import SKIP, code_of, commands, run_sheet, sheet_commands, student_shell

ALL_SHEETS = sorted(glob.glob(os.path.join(ROOT, "experiments", "labs", "[0-9][0-9]_*.md")))
SHEETS = [s for s in ALL_SHEETS if not os.path.basename(s).startswith("06_")]
BARE = re.compile(r"(?<![\w/.-])(python3?|mpiexec|mpirun|pip|pytest)\s+-")


def test_the_commands_are_cut_as_bash_reads_them():
    block = ("cp a b\n# a comment\nx \\\n  --y   # [long: z]\ncat > f <<'T'\nk = 1  # c\nT\n"
             "for s in 0 1; do\n  echo $s \\\n    more\ndone\n")
    assert commands(block) == ["cp a b", "x \\\n  --y   # [long: z]",
                               "cat > f <<'T'\nk = 1  # c\nT",
                               "for s in 0 1; do\n  echo $s \\\n    more\ndone"]
    assert SKIP.search(commands(block)[1]) and not SKIP.search(commands(block)[0])


@pytest.mark.parametrize("sheet", ALL_SHEETS, ids=os.path.basename)
def test_every_command_names_the_venvs_tools(sheet):
    """No bare python/mpiexec (they fail without an activated venv), and every MPI
    launch runs the venv's python under mpi4py (an exception on one rank ends all)."""
    text = open(sheet).read()
    assert not BARE.findall(text), BARE.findall(text)
    for command in sheet_commands(sheet):
        code = " ".join(code_of(line) for line in command.splitlines())
        if "mpiexec" in code:
            assert re.search(r"\.venv/bin/mpiexec -n \d+ \.venv/bin/python -m mpi4py -m ", code), \
                command


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sheet", SHEETS, ids=os.path.basename)
def test_the_sheets_commands_run_as_written(sheet, tmp_path):
    root, env = student_shell(tmp_path)
    assert subprocess.run(["bash", "-c", "command -v mpiexec"], env=env,
                          capture_output=True).returncode != 0, "mpiexec on PATH: not a fresh shell"
    ran = run_sheet([c for c in sheet_commands(sheet) if not SKIP.search(c)], root, env,
                    os.path.basename(sheet))
    print("\n".join(ran))
    assert ran, f"no command of {sheet} ran"
