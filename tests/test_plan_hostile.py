"""Tier (a): the planner's command line against inputs meant to break it.

Every one ends in exit status 2 and one line on stderr that names what is wrong
(the flag, the file and its key), never in a traceback, a hang or a silent
default; each runs in-process through experiments.plan.main, in well under a
second (a million GPUs included: the search never counts to the world; beyond
cluster.MAX_GPUS a cluster is refused).
"""
import json
import time

import pytest

from experiments import plan as plan_cli

MODEL = ["--layers", "8", "--d-model", "512", "--heads", "8", "--seq-len", "256",
         "--vocab", "1024", "--global-batch", "32"]
FIGURES = {"--gpus-per-node": "4", "--gpu-mem-gib": "16", "--gpu-tflops": "100",
           "--intra-gbps": "800", "--inter-gbps": "200"}


def cluster(**changed):
    """The figures of a 2-node cluster, `changed` (flag without its dashes: value) replaced."""
    figures = {**FIGURES, **{f"--{k.replace('_', '-')}": v for k, v in changed.items()}}
    return ["--nodes", "2"] + [x for pair in figures.items() for x in pair]


def model(**changed):
    flags = dict(zip(MODEL[::2], MODEL[1::2]))
    flags.update({f"--{k.replace('_', '-')}": v for k, v in changed.items()})
    return [x for pair in flags.items() for x in pair]


GOOD = {"alpha_s": 2e-5, "beta_s_per_byte": 2e-10, "gamma_s_per_byte": 1e-10}
CALIBRATIONS = {               # name: (the file's text, what the error names)
    "a-list": ("[1, 2, 3]", "JSON list"),
    "a-string-for-a-number": (json.dumps({**GOOD, "beta_s_per_byte": "2e-10"}),
                              "'beta_s_per_byte'"),
    "zero-costs": (json.dumps({**GOOD, "beta_s_per_byte": 0.0}), "'beta_s_per_byte'"),
    "a-missing-key": (json.dumps({"alpha_s": 1e-5}), "'beta_s_per_byte'"),
    "a-negative-latency": (json.dumps({**GOOD, "alpha_s": -1}), "'alpha_s'"),
    "a-vanishing-cost": (json.dumps({**GOOD, "beta_s_per_byte": 1e-300}), "'beta_s_per_byte'"),
    "truncated-arrays": (json.dumps({**GOOD, "beta_bytes": [1, 2, 3],
                                     "beta_s_per_byte_at": [1e-10, 1e-10]}),
                         "'beta_s_per_byte_at'"),
    "a-string-in-an-array": (json.dumps({**GOOD, "gamma_bytes": [1, "2"],
                                         "gamma_s_per_byte_at": [1e-10, 1e-10]}),
                             "'gamma_bytes'"),
    "not-json": ("{alpha_s: 1", "not a JSON file"),
    "a-bad-core-count": (json.dumps({**GOOD, "cores": "eight"}), "'cores'"),
}

HOSTILE = {                     # name: (argv, what the one line must say)
    "no-nodes": (MODEL + cluster(nodes="0"), "--nodes"),
    "negative-nodes": (MODEL + cluster(nodes="-3"), "--nodes"),
    "a-billion-nodes": (MODEL + ["--preset", "dgx-h100", "--nodes", "1000000000"],
                        "--nodes 1000000000"),
    "more-stages-than-layers": (MODEL + ["--preset", "dgx-h100", "--nodes", "131072"],
                                "at most the layers (8)"),
    "beyond-any-count": (MODEL + cluster(nodes="99999999999999"), "--nodes"),
    "every-count-at-its-largest": (model(layers="2147483647", global_batch="2147483647") +
                                   ["--preset", "dgx-h100", "--nodes", "2147483647"],
                                   "GPUs: the planner plans for at most"),
    "a-model-of-two-billion-layers": (model(layers="2147483647") + ["--preset", "dgx-h100"],
                                      "no layout fits"),
    "fp8": (MODEL + cluster() + ["--precision", "fp8"], "'fp8'"),
    "fits-nowhere": (MODEL + cluster(gpu_mem_gib="0.0001"), "no layout fits"),
    "the-users-tp-filter": (MODEL + cluster() + ["--tp-sizes", "16"], "--tp-sizes 16"),
    "the-users-pp-filter": (MODEL + cluster() + ["--pp-sizes", "3"], "--pp-sizes 3"),
    "jsonl-nowhere": (MODEL + cluster() + ["--jsonl", "/nonexistent/x.jsonl"], "--jsonl"),
    "jsonl-a-directory": (MODEL + cluster() + ["--jsonl", "/"], "--jsonl"),
    "out-a-file": (MODEL + cluster() + ["--out", "/etc/passwd"], "--out"),
    "intra-inf": (MODEL + cluster(intra_gbps="inf"), "--intra-gbps"),
    "inter-nan": (MODEL + cluster(inter_gbps="nan"), "--inter-gbps"),
    "negative-peak": (MODEL + cluster(gpu_tflops="-1"), "--gpu-tflops"),
    "no-memory-bandwidth": (MODEL + cluster(hbm_gbps="0"), "--hbm-gbps"),
    "a-denormal-link": (MODEL + cluster(inter_gbps="1e-320"), "--inter-gbps"),
    "an-astronomical-peak": (MODEL + cluster(gpu_tflops="1e300"), "--gpu-tflops"),
    "efficiency-zero": (MODEL + cluster(efficiency="0"), "--efficiency"),
    "efficiency-nan": (MODEL + cluster(efficiency="nan"), "--efficiency"),
    "gemm-best-above-one": (MODEL + cluster(gemm_best="2"), "--gemm-best"),
    "no-layers": (model(layers="0") + cluster(), "--layers"),
    "layers-not-a-number": (model(layers="x") + cluster(), "--layers"),
    "kv-heads-not-dividing": (model(kv_heads="3") + cluster(), "--kv-heads"),
    "no-kv-heads": (model(kv_heads="0") + cluster(), "--kv-heads"),
    "no-ffn": (model(ffn_hidden="0") + cluster(), "--ffn-hidden"),
    "pp-layers-not-adding-up": (MODEL + cluster() + ["--pp-layers", "1,2"], "--pp-layers"),
    "pp-layers-empty-stage": (MODEL + cluster() + ["--pp-layers", "0,8"], "--pp-layers"),
    "micro-batch-zero": (MODEL + cluster() + ["--micro-batch-sizes", "0"],
                         "--micro-batch-sizes"),
    "measure-s-inf": (MODEL + cluster() + ["--measure-s", "inf"], "--measure-s"),
    "zero-not-a-number": (MODEL + cluster() + ["--zero", "1,x"], "--zero"),
    "top-k-above-experts": (model(experts="1", top_k="2") + cluster(), "--experts"),
    "cp-sizes-zero": (MODEL + cluster() + ["--cp-sizes", "0"], "--cp-sizes"),
    "cp-sizes-not-a-number": (MODEL + cluster() + ["--cp-sizes", "2,x"], "--cp-sizes"),
    "cp-not-dividing-the-sequence": (MODEL + cluster() + ["--cp-sizes", "3"], "--cp-sizes 3"),
    "cp-kind-unknown": (MODEL + cluster() + ["--cp-kinds", "stripes"], "--cp-kinds"),
    "ulysses-splitting-a-head": (model(heads="4") + cluster() +
                                 ["--cp-kinds", "ulysses", "--cp-sizes", "8"], "Ulysses"),
    "calibration-nowhere": (MODEL + ["--calibration", "/nonexistent/cal.json"],
                            "does not exist"),
}


def one_line_error(argv, capsys):
    """(exit status, stderr) of main(argv), which must stop within seconds."""
    start = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        plan_cli.main(argv)
    assert time.monotonic() - start < 5, "took longer than a few seconds"
    captured = capsys.readouterr()
    return stop.value.code, captured.err.strip()


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_input_is_one_line_and_exit_2(name, capsys):
    argv, says = HOSTILE[name]
    code, err = one_line_error(argv, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert says in err, err


@pytest.mark.parametrize("name", CALIBRATIONS)
def test_a_hostile_calibration_names_its_file_and_key(name, tmp_path, capsys):
    text, says = CALIBRATIONS[name]
    path = tmp_path / "calibration.json"
    path.write_text(text)
    code, err = one_line_error(MODEL + ["--calibration", str(tmp_path), "--gpus-per-node", "2"],
                               capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert str(path) in err and says in err, err


def test_the_no_layout_message_names_the_rule_that_left_none(capsys):
    """Not a list of every rule: the one that left no size, and the sizes it was given
    (here one key-value head left tp 1 only, and the user's filter asked for 2 or 4)."""
    code, err = one_line_error(model(heads="8", kv_heads="1") + cluster() +
                               ["--tp-sizes", "2,4"], capsys)
    assert code == 2 and "--tp-sizes 2,4 (of tp 1)" in err and "global batch" not in err, err
