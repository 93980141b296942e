"""A 16-bit wire to the parameter servers: --compress fp16 / bf16 under --sync ps.

A push carries each gradient in 16 bits; the server widens it to float32 before it
sums and steps (psrv/protocol.py's to_float32), so only the gradient's own rounding
is lost, once per push, not in every addition as in a 16-bit all-reduce.  The
criterion: after 20 steps the loss is within 2 % of the float32 push's, and the
push's gradient bytes are half (wire_bytes / dense_bytes in the records).
"""
import json

import pytest

from conftest import check_ok, mpirun
from test_parallel_runs import GPT, SEVERAL

STEPS = 20


def runs(tmp_path, nprocs, flags, kinds):
    argvs = [[str(a) for a in GPT + ["--steps", STEPS, "--threads", "1", "--no-progress",
                                     "--compress", kind, "--jsonl", tmp_path / f"{kind}.jsonl"]
              + flags] for kind in kinds]
    check_ok(mpirun(nprocs, SEVERAL + [json.dumps(argvs)], timeout=240))
    out = {}
    for kind in kinds:
        records = [json.loads(line) for line in open(tmp_path / f"{kind}.jsonl")]
        out[kind] = [r for r in records if r["kind"] == "step" and r["rank"] == 0]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags, nprocs", [
    (["--sync", "ps", "--servers", "1"], 3),
    (["--sync", "ps", "--servers", "1", "--dp", "2", "--pp", "2", "--micro-batches", "2"], 5),
], ids=["ps", "ps_dp2_pp2"])
def test_a_16_bit_push_trains_as_float32_does(tmp_path, flags, nprocs):
    out = runs(tmp_path, nprocs, flags, ["none", "bf16", "fp16"])
    final = {kind: records[-1]["loss"] for kind, records in out.items()}
    assert len(out["none"]) == STEPS
    for kind in ("bf16", "fp16"):
        assert abs(final[kind] - final["none"]) <= 0.02 * final["none"], final
        wire = sum(r["wire_bytes"] for r in out[kind])
        dense = sum(r["dense_bytes"] for r in out[kind])
        assert wire == dense // 2, (kind, wire, dense)
