"""The lab sheets' commands run as written, from the repository root, without
activating the venv.

Each fenced ```bash block of experiments/labs/0[1-57-8]_*.md is cut into commands (a
line continued by a backslash, a heredoc and a for-loop are one command each), and
the commands of a sheet run in order with bash, in a scratch copy of the repository
root (its entries linked, a `results/` of its own), with the venv's bin directory
taken off PATH, as in a student's shell where nobody typed `source .venv/bin/activate`.
Where a sheet has the student write a file (my_ring.py, my_zero.toml, ...), the test
puts the right answer there (tests/labs_fixtures/answers.py) before the next command,
so every self-check must end in PASS.

Not run, by the comment a sheet puts on them (about 5 minutes on 2 cores in all):
  # [long: ...]   a minute or more on 2 shared cores: lab 1's calibration, lab 2's
                  sweep, lab 3's ZeRO bench and its four training runs, lab 4's
                  pipeline bench, lab 5's 4-rank grid run, lab 8's six training runs
  # [after ...]   reads what a [long] command wrote (lab 1's check against the
                  calibration, lab 2's report and run check, lab 3's memory table,
                  lab 8's table and figure)
A command whose comment says `exits N` must exit with status N (lab 5's refusals).
Those commands' tools are covered elsewhere: the sweep, report and check_ps on
records by test_experiments_report.py, the benches and grid runs by
test_parallel_runs.py.  Every command, run or not, is linted for the venv's tools.
"""
import glob
import os
import re
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run
from labs_fixtures import answers

SHEETS = sorted(glob.glob(os.path.join(ROOT, "experiments", "labs", "0[1-57-8]_*.md")))
SKIP = re.compile(r"#\s*\[(long|after)\b")
EXITS = re.compile(r"#.*\bexits (\d+)")
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
BARE = re.compile(r"(?<![\w/.-])(python3?|mpiexec|mpirun|pip|pytest)\s+-")
# What a student writes, and the right answer the test writes in its place.
ANSWERS = {"my_ring.py": answers.ring(), "my_zero.toml": answers.ZERO,
           "my_pipeline.toml": answers.PIPELINE, "my_grid.py": answers.GRID,
           "my_ps.toml": answers.PS, "my_compress.toml": answers.COMPRESS,
           "my_precision.toml": answers.PRECISION}
VENV_BIN = os.path.dirname(sys.executable)


def code_of(line):
    """A line without its comment."""
    return re.sub(r"(^|\s)#.*", "", line)


def commands(block):
    """The commands of one bash block, each as one string."""
    out, lines, heredoc, depth = [], [], None, 0
    for line in block.splitlines():
        if not lines and (not line.strip() or line.lstrip().startswith("#")):
            continue                    # a comment or blank line between commands
        lines.append(line)
        if heredoc:
            if line.strip() == heredoc:
                heredoc = None
        else:
            code = code_of(line)
            found = HEREDOC.search(code)
            heredoc = found.group(1) if found else None
            first = code.split()[:1]
            depth += first in (["for"], ["while"], ["if"])
            depth -= first in (["done"], ["fi"])
            if code.rstrip().endswith("\\"):
                continue
        if heredoc is None and depth == 0:
            out.append("\n".join(lines))
            lines = []
    assert not lines, f"unfinished command: {lines}"
    return out


def sheet_commands(path):
    text = open(path).read()
    return [c for block in re.findall(r"```bash\n(.*?)```", text, re.S) for c in commands(block)]


def student_shell(tmp_path):
    """(cwd, env): a scratch repository root and a PATH without the venv."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in os.listdir(ROOT):
        if name != "results" and not name.startswith("my_"):
            os.symlink(os.path.join(ROOT, name), root / name)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and os.path.realpath(p) != os.path.realpath(VENV_BIN))
    env["OMP_NUM_THREADS"] = "1"        # speed on shared cores; not needed to run
    return root, env


def test_the_commands_are_cut_as_bash_reads_them():
    block = ("cp a b\n# a comment\nx \\\n  --y   # [long: z]\ncat > f <<'T'\nk = 1  # c\nT\n"
             "for s in 0 1; do\n  echo $s \\\n    more\ndone\n")
    assert commands(block) == ["cp a b", "x \\\n  --y   # [long: z]",
                               "cat > f <<'T'\nk = 1  # c\nT",
                               "for s in 0 1; do\n  echo $s \\\n    more\ndone"]
    assert SKIP.search(commands(block)[1]) and not SKIP.search(commands(block)[0])


@pytest.mark.parametrize("sheet", SHEETS, ids=os.path.basename)
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


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sheet", SHEETS, ids=os.path.basename)
def test_the_sheets_commands_run_as_written(sheet, tmp_path):
    root, env = student_shell(tmp_path)
    assert subprocess.run(["bash", "-c", "command -v mpiexec"], env=env,
                          capture_output=True).returncode != 0, "mpiexec on PATH: not a fresh shell"
    filled, ran = set(), []
    for command in sheet_commands(sheet):
        if SKIP.search(command):
            continue
        expected = int(EXITS.search(command).group(1)) if EXITS.search(command) else 0
        start = time.monotonic()
        result = run(["bash", "-o", "pipefail", "-c", command], 200, env, cwd=root)
        ran.append(f"{time.monotonic() - start:5.1f} s  {command.splitlines()[0][:90]}")
        assert result.returncode == expected, (
            f"{os.path.basename(sheet)}: exit {result.returncode}, not {expected}:\n{command}\n"
            f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
        for name, text in ANSWERS.items():
            if name not in filled and (root / name).exists():
                (root / name).write_text(text)       # the student's answer, right
                filled.add(name)
    print("\n".join(ran))
    assert ran, f"no command of {sheet} ran"
