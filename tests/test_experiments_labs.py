"""The labs' self-check scripts: they accept right answers, reject wrong ones with a
reason, and never print the expected figures of a pen-and-paper answer."""
import os
import re

import pytest
from conftest import ROOT
from labs_fixtures import answers

from experiments.labs import check_answers



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


@pytest.mark.timeout(30)
def test_check_answers_context_grades_ring_and_ulysses_without_giving_them_away(tmp_path,
                                                                                 capsys):
    def check(text):
        return answer(tmp_path, capsys, check_answers.main, "context", text, "my_context.toml")
    status, out = check(answers.CONTEXT)
    assert status == 0 and out.count("ok ") == 6 and "PASS" in out
    # the forward's blocks only (2 (cp-1) a layer, 262,144 at T = 64), and Ulysses' four
    # buffers sent whole instead of (cp-1)/cp of each
    wrong = (answers.CONTEXT.replace("cp2_seq64 = 1_048_576", "cp2_seq64 = 262_144")
             .replace("cp2_seq512 = 4_194_304", "cp2_seq512 = 8_388_608"))
    status, out = check(wrong)
    assert status == 1 and "FAIL: 2 wrong" in out
    assert "WRONG ring.cp2_seq64: yours 262144" in out
    assert "WRONG ulysses.cp2_seq512: yours 8388608" in out and "ok    ring.cp2_seq512" in out
    assert not figures(out) & {1_048_576, 4_194_304}, out
    with pytest.raises(SystemExit, match="cpN_seqT"):
        check(answers.CONTEXT.replace("cp8_seq4096", "cp8"))
