"""Tier (c): experiments.calibrate on one host, end to end.

Its three parts run as they do for a user: the MPI probes under mpiexec -n 2
(calibrate.mpi_part), psrv's push+pull with W = 1, 2, 3 workers (calibrate_ps.py),
and the alpha-beta fits of both (fits.py), all into DIR/calibration.json.  The
figures are this machine's, so only their presence and sign are checked here;
tests/test_experiments_costmodel.py checks the fits on hand-computed values.
"""
import json
import sys

import pytest

from conftest import check_ok, mpi_env, run


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_calibrate_writes_both_parts(tmp_path):
    result = check_ok(run([sys.executable, "-m", "experiments.calibrate", "--reps", "1",
                           "--verify", "ring", "--out", tmp_path, "--jsonl",
                           tmp_path / "records.jsonl"], 180, mpi_env(TOPOLAB_CHECK="0")))
    assert "wrote" in result.stdout, result.stdout
    cal = json.load(open(tmp_path / "calibration.json"))
    for key in ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte", "ps_beta_s_per_byte"):
        assert cal[key] > 0, (key, cal[key])
    assert cal["ps_alpha_s"] >= 0
    assert len(cal["ps_s"]) == len(cal["ps_marginal_s"]) == len(cal["ps_bytes"])
    # --verify: the ring timed in the probes' rounds, and psrv's W = 3 kept to check
    assert {v["algo"] for v in cal["verify"]} == {"ring"}
    assert {m["workers"] for m in cal["ps_measured"]} == {1, 2, 3}
    assert cal["ps_verify"] and all(v["workers"] == 3 for v in cal["ps_verify"])
    (record,) = [json.loads(line) for line in open(tmp_path / "records.jsonl")]
    assert record["kind"] == "calibration" and "provenance" in record
