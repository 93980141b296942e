"""The lab sheets' commands, as a student's shell meets them: cut from a sheet's
```bash blocks, run one by one from a scratch copy of the repository root with the
venv off PATH, the student's files replaced by right answers (answers.py).

Used by tests/test_lab_commands.py (labs 1-5, 7-10), tests/test_lab6.py (lab 6, as
root) and tests/test_lab_keys.py (the teacher's figures regenerated); key_table and
number read a teacher's key for the tests that regenerate its figures."""
import os
import re
import sys
import time

from conftest import ROOT, run

from labs_fixtures import answers

SKIP = re.compile(r"#\s*\[(long|after)\b")
EXITS = re.compile(r"#.*\bexits (\d+)")
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
# A shell variable set by a sheet (lab 6's SUDO=...): later commands see it, as in
# the student's one shell.
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
# What a student writes, and the right answer the test writes in its place.
ANSWERS = {"my_ring.py": answers.ring(), "my_zero.toml": answers.ZERO,
           "my_pipeline.toml": answers.PIPELINE, "my_grid.py": answers.GRID,
           "my_ps.toml": answers.PS, "my_compress.toml": answers.COMPRESS,
           "my_precision.toml": answers.PRECISION, "my_cluster.toml": answers.CLUSTER,
           "my_context.toml": answers.CONTEXT}
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


def run_sheet(commands_of_sheet, root, env, name, timeout=200):
    """Run `commands_of_sheet` in order in the scratch root, each as bash would in the
    student's shell (the sheet's variables set before it), filling in the student's
    files after the command that creates them.  A command whose comment says
    `exits N` must exit N, any other 0.  Returns a line per command with its time."""
    filled, ran, variables = set(), [], []
    for command in commands_of_sheet:
        expected = int(EXITS.search(command).group(1)) if EXITS.search(command) else 0
        start = time.monotonic()
        result = run(["bash", "-o", "pipefail", "-c", "\n".join(variables + [command])],
                     timeout, env, cwd=root)
        ran.append(f"{time.monotonic() - start:5.1f} s  {command.splitlines()[0][:90]}")
        assert result.returncode == expected, (
            f"{name}: exit {result.returncode}, not {expected}:\n{command}\n"
            f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
        if ASSIGNMENT.match(command):
            variables.append(command)
        for file_name, text in ANSWERS.items():
            if file_name not in filled and (root / file_name).exists():
                (root / file_name).write_text(text)       # the student's answer, right
                filled.add(file_name)
    return ran


def key_table(text, first_cell):
    """The rows (lists of cells) of the Markdown table in `text` (a teacher's key) whose
    header starts with `first_cell`."""
    lines = text[text.index(f"| {first_cell} |"):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def number(cell):
    """The first whole number of a key's cell, its thousands' commas dropped."""
    return int(re.search(r"\d[\d,]*", cell).group().replace(",", ""))
