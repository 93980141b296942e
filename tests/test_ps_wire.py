"""The parameter servers take what the collectives take: a 16-bit wire and fp16's skips.

--compress fp16 / bf16 under --sync ps: a push carries each gradient in 16 bits, and
the server widens it to float32 before it sums and steps (psrv/protocol.py's
to_float32), so only the gradient's own rounding is lost, once per push, not in every
addition as in a 16-bit all-reduce.  The criterion: after 20 steps the loss is within
2 % of the float32 push's, and the push's gradient bytes are half (wire_bytes /
dense_bytes in the records).  --precision fp16 trains within 2 % of fp32 as well.

fp16's skips: the workers vote on an overflow before they push, and skip the push and
the update together, so a skipped step never reaches the servers.  The same run over
the ring (whose all-reduced gradient is inf wherever one rank's is) skips the same
steps; both must then hold the same parameters (FP16_RTOL: only the order of additions
differs, in fp16's autocast).
"""
import json

import numpy as np
import pytest

from conftest import check_ok, mpirun
from test_parallel_runs import GPT, SEVERAL

STEPS = 20
# fp16's autocast rounds every matmul to 11 bits, so a reordered sum (the stages' micro-
# batches, the servers' average) moves values by more than float32's few ulps: measured
# <= 9e-6 after 8 steps, where a skipped or doubled step moves them by ~1e-2
FP16_RTOL, FP16_ATOL = 1e-4, 1e-5
PS = ["--sync", "ps", "--servers", "1"]
GRID = ["--dp", "2", "--pp", "2", "--micro-batches", "2"]


def runs(tmp_path, nprocs, variants, steps=STEPS):
    """Each {name: flags} trained in one launch; {name: (rank 0's step records, params)}."""
    argvs = [[str(a) for a in GPT + ["--steps", steps, "--threads", "1", "--no-progress",
                                     "--jsonl", tmp_path / f"{name}.jsonl",
                                     "--params-out", tmp_path / f"{name}.npz"] + flags]
             for name, flags in variants.items()]
    check_ok(mpirun(nprocs, SEVERAL + [json.dumps(argvs)], timeout=240))
    out = {}
    for name in variants:
        records = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
        out[name] = ([r for r in records if r["kind"] == "step" and r["rank"] == 0],
                     dict(np.load(tmp_path / f"{name}.npz")))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags, nprocs", [(PS, 3), (PS + GRID, 5)], ids=["ps", "ps_dp2_pp2"])
def test_a_16_bit_push_and_fp16_train_as_float32_does(tmp_path, flags, nprocs):
    out = runs(tmp_path, nprocs, {
        "none": flags, "bf16": flags + ["--compress", "bf16"],
        "fp16": flags + ["--compress", "fp16"], "fp16_precision": flags + ["--precision", "fp16"]})
    final = {name: records[-1]["loss"] for name, (records, _) in out.items()}
    assert len(out["none"][0]) == STEPS
    for name in ("bf16", "fp16", "fp16_precision"):
        assert abs(final[name] - final["none"]) <= 0.02 * final["none"], final
    for name in ("bf16", "fp16"):
        wire = sum(r["wire_bytes"] for r in out[name][0])
        dense = sum(r["dense_bytes"] for r in out[name][0])
        assert wire == dense // 2, (name, wire, dense)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, nprocs, plain", [
    ([], 3, []),
    # the grid's stages against the whole model on 2 ranks with the same micro-batches:
    # the grid's ring keeps 16-bit parameters (ZeRO's buffers), the servers fp32 ones
    (GRID, 5, ["--micro-batches", "2"])], ids=["dp2", "dp2_pp2"])
def test_an_fp16_overflow_skips_the_push_and_the_update_together(tmp_path, layout, nprocs,
                                                                  plain):
    # a loss scale of 2^24 overflows the first steps; each halves it until one fits
    fp16 = ["--precision", "fp16", "--loss-scale", "16777216"]
    ps, ps_params = runs(tmp_path, nprocs, {"ps": PS + fp16 + layout}, steps=8)["ps"]
    ring, ring_params = runs(tmp_path, 2, {"ring": ["--sync", "ring"] + fp16 + plain},
                             steps=8)["ring"]
    skips = [r["overflow_skips"] for r in ps]
    assert skips == [r["overflow_skips"] for r in ring]
    assert 1 <= skips[-1] < 8, skips               # some steps skipped, some applied
    np.testing.assert_allclose([r["loss"] for r in ps], [r["loss"] for r in ring],
                               rtol=FP16_RTOL, atol=FP16_ATOL)
    for name in ring_params:
        np.testing.assert_allclose(ps_params[name], ring_params[name], rtol=FP16_RTOL,
                                   atol=FP16_ATOL, err_msg=name)
