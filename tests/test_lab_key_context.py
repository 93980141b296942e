"""Lab 10's key follows the formulas and the sheet's own runs.

  the pen-and-paper table        check_answers' context grading (context_bytes), exactly,
                                 and it answers every line of the sheet's my_context.toml
  the template's b, C, L         the sheet's sweep: --global-batch, TrainConfig's d_model
                                 and layers
  the measured bytes (slow)      the sheet's commands run as written, the sweep and what
                                 reads it included: every rank's cp_bytes and bytes_sent
                                 of each (kind, T) as the key prints them, and question
                                 2's relation (the rest of bytes_sent grows only by the
                                 position embedding's T C parameters)

The key's times: none.  cp_time_s and step_time_s are the machine's own and move by
tens of per cent from run to run; with no record behind them, the key says what a
student should see (which rank waits longer, how it moves with T) and with what command.
"""
import json
import os
import re
import subprocess
import tomllib

import pytest
from conftest import ROOT
from labs_fixtures.sheets import key_table, number, run_sheet, sheet_commands, student_shell

from experiments.labs import check_answers
from strategies.config.settings import TrainConfig

LABS = os.path.join(ROOT, "experiments", "labs")
SHEET = os.path.join(LABS, "10_ring_vs_ulysses.md")
KEY = open(os.path.join(LABS, "teacher", "10_answers.md")).read()


def table(first_cell):
    """The rows of the key's table whose header starts with `first_cell`."""
    return key_table(KEY, first_cell)


def template():
    """The sheet's my_context.toml, as a student first writes it."""
    command = next(c for c in sheet_commands(SHEET) if "my_context.toml <<" in c)
    return tomllib.loads(command.split("\n", 1)[1].rsplit("\n", 1)[0])


def sweep():
    """The sheet's sweep: (its T values, its kinds, its training command's text)."""
    command = next(c for c in sheet_commands(SHEET) if c.startswith("for seq in"))
    seqs = re.match(r"for seq in ([\d ]+);", command).group(1).split()
    kinds = re.search(r"for kind in ([\w ]+);", command).group(1).split()
    return [int(s) for s in seqs], kinds, command


@pytest.mark.timeout(30)
def test_lab10_pen_and_paper_follows_check_answers():
    given = template()
    rows = {row[0].strip("`"): number(row[1].replace("*", "")) for row in table("answer")}
    asked = {f"{kind}.{key}" for kind in ("ring", "ulysses") for key in given[kind]}
    assert asked <= set(rows), asked - set(rows)
    answers = {k: given[k] for k in ("batch", "d_model", "layers")}
    for name, value in rows.items():
        kind, key = name.split(".")
        answers.setdefault(kind, {})[key] = value
    graded = list(check_answers.check_context(answers))
    assert {name for name, _, _ in graded} == set(rows)
    for name, got, want in graded:
        assert got == want, name


@pytest.mark.timeout(30)
def test_lab10_template_describes_the_sweeps_model():
    given, (_, _, command) = template(), sweep()
    assert f"--global-batch {given['batch']} " in command and "--cp 2 " in command
    assert "--d-model" not in command and "--layers" not in command      # the defaults
    defaults = TrainConfig()
    assert (defaults.d_model, defaults.layers) == (given["d_model"], given["layers"])


@pytest.mark.timeout(30)
def test_lab10_key_gives_no_time_without_a_record():
    """Figures link to a record (docs/measurements/); the key has none for times, so it
    prints none: no milliseconds, no time column in its measured table."""
    assert not re.findall(r"\d\s*ms\b", KEY), re.findall(r".{30}\d\s*ms\b", KEY)
    header = KEY[KEY.index("| kind | T |"):].splitlines()[0]
    assert "time" not in header, header


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_lab10_measured_bytes_are_what_the_sheets_runs_record(tmp_path):
    """Every command of the sheet, in order, as a student runs them (the long sweep and
    the [after] table and figure too); then the key's bytes against the records."""
    root, env = student_shell(tmp_path)
    env["TOPOLAB_CHECK"] = "0"      # as a student runs it: no signature exchange before each
    # collective, which would add to bytes_sent and to Ulysses' cp_bytes
    assert subprocess.run(["bash", "-c", "command -v mpiexec"], env=env,
                          capture_output=True).returncode != 0, "mpiexec on PATH"
    print("\n".join(run_sheet(sheet_commands(SHEET), root, env, "lab 10", timeout=400)))
    assert (root / "results" / "labs" / "context.png").exists()
    records = [json.loads(line) for line in open(root / "results" / "labs" / "lab10.jsonl")]
    config = {r["run_id"]: r for r in records if r["kind"] == "config"}
    recorded = {}                   # (kind, T) -> {(cp_bytes, bytes_sent) of every step, rank}
    for r in records:
        if r["kind"] == "step":
            c = config[r["run_id"]]
            recorded.setdefault((c["cp_kind"], c["seq_len"]), set()).add(
                (r["cp_bytes"], r["bytes_sent"]))
    seqs, kinds, _ = sweep()
    rows = {(row[0], int(row[1])): (number(row[2]), number(row[3]))
            for row in table("kind | T")}
    assert set(rows) == set(recorded) == {(k, s) for k in kinds for s in seqs}
    for run, figures in rows.items():
        assert recorded[run] == {figures}, (run, recorded[run])
    # question 2: bytes_sent - cp_bytes is the gradients' all-reduce, 4 bytes a parameter
    # at P = 2 (2 (P-1)/P of 4 bytes); it grows only by the position embedding's T C
    for kind in kinds:
        rest = {s: rows[(kind, s)][1] - rows[(kind, s)][0] for s in seqs}
        for a, b in zip(seqs, seqs[1:]):
            assert rest[b] - rest[a] == 4 * TrainConfig().d_model * (b - a), (kind, a, b)


@pytest.mark.timeout(60)
def test_the_figure_reads_the_records(tmp_path):
    """context_plots draws each (kind, T) once, rank 0's bytes beside the formula, and
    each rank's median wait over the steps after the first."""
    from experiments.context_plots import context, context_runs
    from strategies.parallel.context_parallel import context_bytes
    records = []
    for run, (kind, seq) in enumerate([("ring", 64), ("ulysses", 64), ("ring", 128)]):
        config = TrainConfig(sync="ring", model="gpt", cp=2, cp_kind=kind, seq_len=seq,
                             global_batch=8).as_dict()
        records.append({"kind": "config", "run_id": run, **config, "dp_size": 1,
                        "tp_size": 1, "cp_size": 2})
        sent = context_bytes(kind, 8, seq, 64, 2, 2)
        records += [{"kind": "step", "run_id": run, "step": step, "rank": rank,
                     "cp_bytes": sent, "cp_time_s": 9.0 if step == 0 else 0.001 * (rank + 1)}
                    for step in range(3) for rank in range(2)]
    runs = context_runs(records)
    assert set(runs) == {"ring", "ulysses"} and sorted(runs["ring"]) == [64, 128]
    sent, formula, waits = runs["ring"][128]
    assert sent == formula == 2 * runs["ring"][64][0] == 4 * runs["ulysses"][64][0]
    assert waits == {0: 0.001, 1: 0.002}                  # step 0's 9 s left out
    assert context(records, tmp_path).endswith("context.png")
    assert context([], tmp_path) is None
