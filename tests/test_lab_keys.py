"""The teacher's keys cannot go stale: every figure of a key that can be regenerated in
seconds is regenerated, from the project's formulas or from the sheet's own command,
and compared with what the key prints.

  lab 1  the paper tables (chunk sent at each step)    the five TODOs' formulas, exactly
  lab 2  the predictions table                         check_ps's formulas, within 1 byte
  lab 6  the pen-and-paper table and its bonus row     check_cluster's reference: bytes
                                                       exactly, ms within 0.05
         question 7's hierarchical / ring per host     the sheet's simulate command, run on
                                                       the calibration the key was written
                                                       from, within 0.0005 (3 decimals)
  lab 8  the pen-and-paper table, the wire figures     compressor.wire_bytes_sent, exactly
         of the Measure section, question 4's P
  lab 4  the table, the interleaved row included       check_answers' pipeline formulas
         question 4's relation (slow)                  a bench_parallel run made here
  lab 5  question 2's ring ms over the slow link       the sheet's simulate command
  lab 1  question 6's relation (slow)                  a calibration made here
Elsewhere: lab 2's relations (tests/test_lab_ps.py), labs 3 and 7's memory tables
(tests/test_lab_key_memory.py), lab 9's planner answers (tests/test_lab_key_plan.py), lab 10's bytes
(tests/test_lab_key_context.py).

Not regenerated: measured times, losses and bytes of benches and training runs
(minutes each, and machine-dependent); the keys say which run they come from.
"""
import os
import re
import sys

import pytest
from conftest import ROOT, mpi_env, run
from labs_fixtures.sheets import sheet_commands

from experiments.labs import check_cluster, check_ps
from strategies.config.compress_spec import topk_count, wire_bytes_sent

LABS = os.path.join(ROOT, "experiments", "labs")
FIXTURES = os.path.join(ROOT, "tests", "labs_fixtures")


def key(lab):
    name = next(f for f in os.listdir(os.path.join(LABS, "teacher")) if f.startswith(f"{lab:02d}_"))
    return open(os.path.join(LABS, "teacher", name)).read()


def number(text):
    """The first number of a table cell or phrase: 25,165,824 (1.5 n) -> 25165824."""
    return float(re.search(r"-?\d[\d,]*\.?\d*", text).group().replace(",", ""))


def table(text, first_cell):
    """The rows (as lists of cells) of the markdown table whose header starts with
    `first_cell`."""
    lines = text[text.index(f"| {first_cell} |"):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.strip().startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def table_header(text, first_cell):
    """The header cells after the first of the table whose header starts with `first_cell`."""
    line = text[text.index(f"| {first_cell} |"):].splitlines()[0]
    return [cell.strip() for cell in line.strip().strip("|").split("|")][1:]


@pytest.mark.timeout(10)
def test_lab1_paper_tables_follow_the_todos_formulas():
    text, P = key(1), 4
    for header, chunk in (("reduce-scatter", lambda r, s: (r - s - 1) % P),
                          ("all-gather", lambda r, s: (r - s) % P)):
        rows = table(text, header)
        assert len(rows) == P - 1
        for s, row in enumerate(rows):
            assert row[1:] == [f"c{chunk(r, s)}" for r in range(P)], (header, row)


@pytest.mark.timeout(10)
def test_lab2_predictions_follow_check_ps():
    rows = {row[0].strip("`"): number(row[1]) for row in table(key(2), "key")}
    setting = {"params": 1_000_000, "workers": 2, "servers": 1, "ring_ranks": 3}
    right = {name: want for name, _, want in check_ps.predictions(setting)}
    assert set(rows) == set(right)
    for name, value in rows.items():
        assert value == pytest.approx(right[name], abs=1), name


@pytest.mark.timeout(10)
def test_lab6_pen_and_paper_follows_check_cluster():
    text = key(6)
    n = 16 << 20
    for layout, algo, nbytes, ms, _ in table(text, "layout"):
        nodes, R = map(int, layout.split("x"))
        busiest, link_ms = check_cluster.expected(algo, n, nodes, R, 1)
        assert number(nbytes) == busiest and number(ms) == pytest.approx(link_ms, abs=0.05), \
            (layout, algo)
    bonus = text[text.index("(Bonus, 4x2:"):].split(")", 1)[0]
    for algo, multiple, ms in re.findall(r"(\w+) ([\d.]+) n /\s+([\d.]+) ms", bonus):
        busiest, link_ms = check_cluster.expected(algo, n, 4, 2, 1)
        assert float(multiple) * n == busiest and float(ms) == pytest.approx(link_ms, abs=0.05), \
            algo


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_lab6_question_7_is_what_the_sheets_simulate_command_prints(tmp_path):
    """The sheet's last command, on the calibration the key names."""
    command = next(c for c in sheet_commands(os.path.join(LABS, "06_cluster_topologies.md"))
                   if "experiments.simulate" in c)
    command = re.sub(r"#.*", "", command).replace("\\\n", " ")
    assert "results/lab6/cal-1g" in command and "--sizes 16M" in command, command
    argv = command.replace("results/lab6/cal-1g",
                           os.path.join(FIXTURES, "lab6_cal_1g.json")).split()
    assert argv[0] == ".venv/bin/python"
    result = run([sys.executable, *argv[1:]], 50, mpi_env())
    assert result.returncode == 0, result.stderr
    printed = {}                                      # hosts -> hierarchical / ring at 16M
    lines = result.stdout.split("below 1: faster than the ring)\n")[1].splitlines()
    column = lines[0].split().index("hierarchical") - 1     # the "|" has no header
    for line in lines[1:]:
        cells = line.split()
        printed[int(cells[1])] = float(cells[column])
    hosts = [int(h) for h in table_header(key(6), "hosts")]
    ratios = [float(x) for x in table(key(6), "hosts")[0][1:]]
    assert len(hosts) == len(ratios) >= 8
    for h, ratio in zip(hosts, ratios):
        assert printed[h] == pytest.approx(ratio, abs=5e-4), h


@pytest.mark.timeout(10)
def test_lab8_figures_follow_the_compressors_accounting():
    text = key(8)
    rows = {row[0].strip("`"): number(row[1].replace("*", "")) for row in table(text, "answer")}
    topk, dense = wire_bytes_sent(1_000_000, 0.01, 4)
    assert rows == {"dense_bytes": dense, "topk_bytes": topk, "break_even_ratio": 1 / 4}
    # Measure: the MLP's one bucket of 142,602 parameters at P = 2
    n = 142_602
    topk, dense = wire_bytes_sent(n, 0.01, 2)
    measure = text[text.index("## Measure"):text.index("## Questions")]
    for figure in (n, topk_count(n, 0.01), topk, dense, 2 * topk, 2 * dense):
        assert f"{round(figure):,}" in measure, figure
    assert f"`wire_ratio` {100 * topk / dense:.1f} %" in measure
    # question 4: the first P at which top-k over an all-gather sends more than the ring
    first = next(P for P in range(2, 10_000) if wire_bytes_sent(10 ** 6, 0.01, P)[0]
                 > wire_bytes_sent(10 ** 6, 0.01, P)[1])
    answer = text[text.index("\n4. "):]
    assert f"from P = {first} " in answer, answer[:300]


def cell_figure(cell):
    """A key's answer cell: the figure after its last = or ≈ ('3/11 ≈ 0.2727'), else its
    first number ('8: all forwards ...')."""
    head = cell.split(":")[0] if re.match(r"\d+\s*[:=]", cell) else cell
    parts = re.split(r"[=≈]", head)
    return number(parts[-1] if len(parts) > 1 and re.search(r"\d", parts[-1]) else head)


@pytest.mark.timeout(10)
def test_lab4_table_follows_check_answers_pipeline():
    """Every row of the key's table, the interleaved one included, is what
    check_answers grades it against (costmodel's bubble and in-flight formulas)."""
    from experiments.labs import check_answers
    rows = {row[0].strip("`"): cell_figure(row[1]) for row in table(key(4), "key")}
    answers = {"stages": 4}
    for name, value in rows.items():
        section, field = name.split(".")
        answers.setdefault(section, {})[field] = value
    graded = list(check_answers.check_pipeline(answers))
    assert {name for name, _, _ in graded} == set(rows) and "bubble_interleaved.v2_m8" in rows
    for name, got, want in graded:
        assert got == pytest.approx(want, abs=5e-5), name


@pytest.mark.timeout(60)
def test_lab5_question_2_is_what_the_sheets_simulate_command_prints():
    """The ring's ms of tp's and dp's all-reduce over the slow link, as the sheet's
    command prints them, and the relation the key draws: tp across the link costs
    several times dp's all-reduce a step."""
    command = next(c for c in sheet_commands(os.path.join(LABS, "05_3d_parallelism.md"))
                   if "experiments.simulate" in c)
    argv = re.sub(r"#.*", "", command).split()
    result = run([sys.executable, *argv[1:]], 50, mpi_env())
    assert result.returncode == 0, result.stderr
    printed = {}
    for line in result.stdout.split("below 1: faster than the ring)\n")[1].splitlines()[1:]:
        cells = line.split()
        printed[cells[2]] = float(cells[3])
    rows = {row[1]: row for row in table(key(5), "axis | message")}
    assert set(rows) == set(printed) == {"8M", "155M"}
    for size, row in rows.items():
        assert number(row[2]) == pytest.approx(printed[size], abs=5e-4), size
    per_step = 48 * 4 * printed["8M"]
    assert number(rows["8M"][4].split("≈")[1]) == pytest.approx(per_step, rel=0.002)
    assert per_step > 5 * printed["155M"]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_lab4_question_4_relation_holds_on_a_bench_run(tmp_path):
    """The key's relation, on a run made here: interleaving (v = 2, m = 8) shrinks the
    measured bubble by less than v against 1F1B at m = 8, and stays above its formula."""
    out = tmp_path / "pipe.jsonl"
    result = run([os.path.join(ROOT, ".venv", "bin", "mpiexec"), "-n", "2", sys.executable,
                  "-m", "mpi4py", "-m", "strategies.bench_parallel", "--part", "pipeline",
                  "--steps", "6", "--jsonl", str(out)], 380, mpi_env(TOPOLAB_CHECK="0"))
    assert result.returncode == 0, result.stderr[-2000:]
    import json
    rows = {(r["schedule"], r["m"], r["v"]): r for r in map(json.loads, open(out))
            if r.get("kind") == "pipeline"}
    plain, inter = rows[("1f1b", 8, 1)], rows[("interleaved", 8, 2)]
    assert inter["bubble"] > plain["bubble"] / 2, (plain["bubble"], inter["bubble"])
    assert inter["bubble"] > inter["theory"], inter
    assert "more than 1/v of the measured 1F1B bubble at m = 8" in key(4)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_lab1_question_6_relation_holds_on_a_calibration(tmp_path):
    """alpha_s, a measured step, lies within a factor 3 of the smallest exchange the
    calibration times; the key says so, and leaves the direction to alpha_exchange_s
    open."""
    result = run([sys.executable, "-m", "experiments.calibrate", "--no-ps", "--reps", "3",
                  "--verify", "", "--out", str(tmp_path)], 280, mpi_env(TOPOLAB_CHECK="0"))
    assert result.returncode == 0, result.stderr[-2000:]
    import json
    cal = json.load(open(tmp_path / "calibration.json"))
    assert cal["exchange_s"][0] / 3 <= cal["alpha_s"] <= 3 * cal["exchange_s"][0], cal
    assert "within a factor 3 of `exchange_s[0]`" in key(1)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("lab,precision", [(3, "fp32"), (7, "bf16")])
def test_lab3_and_7_pen_and_paper_follow_costmodel(lab, precision):
    """Every part of each stage's row, and its total, from costmodel.zero_memory at
    the key's ψ = 10⁶, N = 4; lab 7's momentum row too."""
    from experiments import costmodel
    rows = table(key(lab), "stage | shards")
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    for row in rows:
        want = costmodel.zero_memory(1_000_000, 4, int(row[0]), precision)
        got = [number(cell) for cell in row[2:6]]
        assert got == [want["params"], want["grads"], want["optimizer"], sum(want.values())], row
    if lab == 7:
        momentum = costmodel.zero_memory(1_000_000, 4, 0, "bf16", "momentum")
        assert f"**{round(sum(momentum.values())):,}**" in key(7)


@pytest.mark.timeout(10)
def test_lab5_per_axis_table_and_bubble_follow_the_formulas():
    """The 1.3B GPT (24 layers, h = s = 2048, b = 1, 2 bytes) on tp 8, pp 2, dp 4:
    tp's four all-reduces of b s h a layer, 12 layers a stage, a ring's 2(P-1)/P;
    pp's one activation; dp's ring over psi/(tp pp); question 3's bubble."""
    from experiments import costmodel
    act = 1 * 2048 * 2048 * 2
    tp = 4 * 12 * 2 * 7 / 8 * act
    dp = 2 * 3 / 4 * 1.3e9 / 16 * 2
    rows = {row[0]: row[2] for row in table(key(5), "axis | what")}
    assert number(rows["tp = 8"].split("≈")[1]) == pytest.approx(tp / 1e6, rel=0.005)
    assert number(rows["pp = 2"].split("≈")[1]) == pytest.approx(act / 1e6, rel=0.005)
    assert number(rows["dp = 4"].split("≈")[1]) == pytest.approx(dp / 1e6, rel=0.005)
    assert costmodel.bubble_fraction(2, 4) == pytest.approx(0.2)
    assert "(p − 1)/(m + p − 1) = 1/5 = 20 %" in key(5)
