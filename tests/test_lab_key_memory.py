"""Labs 3 and 7: the keys' tables of measured `memory` are what the sheets' own runs
record, byte for byte.  The runs are the sheets' commands (the for-loops' bodies,
with the loop variable filled in), a few seconds each under mpiexec."""
import json
import os
import re
import shlex
import sys

import pytest
from conftest import ROOT, mpi_env, run
from labs_fixtures.sheets import key_table as table, number, sheet_commands

LABS = os.path.join(ROOT, "experiments", "labs")


def key(name):
    return open(os.path.join(LABS, "teacher", name)).read()


def train_loop(sheet, variable):
    """The argv of the sheet's `for VARIABLE in ...` training command (python's part),
    with the loop's values."""
    for command in sheet_commands(os.path.join(LABS, sheet)):
        loop = re.match(rf"for {variable} in ([\w ]+);", command)
        if loop and "strategies.train" in command:
            body = command[command.index("do") + 2:command.rindex("done")]
            body = re.sub(r"#.*", "", body).replace("\\\n", " ")
            argv = shlex.split(body)
            return loop.group(1).split(), argv
    raise AssertionError(f"{sheet} has no `for {variable}` training loop")


def last_memory(argv, value, variable, tmp_path):
    """Rank 0's last step record of one run of the loop's command."""
    argv = [a.replace(f"${variable}", value) for a in argv]
    i = argv.index("--jsonl")
    argv[i + 1] = str(tmp_path / f"{value}.jsonl")
    assert argv[0] == ".venv/bin/mpiexec", argv
    python = argv.index(".venv/bin/python")
    argv = [os.path.join(ROOT, argv[0]), *argv[1:python], sys.executable, *argv[python + 1:]]
    result = run(argv, 120, mpi_env(TOPOLAB_CHECK="0"))   # as a student runs it: no
    # signature exchange before each collective, which would add to bytes_sent
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in open(argv[argv.index("--jsonl") + 1])]
    return [r for r in records if r.get("kind") == "step" and r["rank"] == 0][-1]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_lab3_keys_memory_table_is_what_the_sheets_runs_record(tmp_path):
    stages, argv = train_loop("03_zero_memory.md", "stage")
    rows = table(key("03_answers.md"), "stage | params | grads | optimizer | gathered_peak")
    assert [row[0] for row in rows] == stages == ["0", "1", "2", "3"]
    for row in rows:
        memory = last_memory(argv, row[0], "stage", tmp_path)["memory"]
        got = [memory[k] for k in ("params", "grads", "optimizer", "gathered_peak")]
        assert got == [number(c) for c in row[1:]], (row, memory)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_lab7_keys_memory_table_is_what_the_sheets_runs_record(tmp_path):
    precisions, argv = train_loop("07_mixed_precision.md", "precision")
    rows = table(key("07_answers.md"), "precision")
    assert [row[0] for row in rows] == precisions == ["fp32", "bf16"]
    for row in rows:
        record = last_memory(argv, row[0], "precision", tmp_path)
        memory = record["memory"]
        got = [memory["params"], memory["grads"], memory["optimizer"],
               memory["activations_peak"], record["bytes_sent"]]
        assert got == [number(c) for c in row[1:]], (row, record)
