"""Top-k, PowerSGD and fp8 on the wire to the parameter servers (psrv/protocol.py's codes 7-9).

Tier (a): a push encoded by the compressors' own `encode` (server_buckets.PushEncoder)
decodes on the server side (protocol.to_float32) into exactly what the worker sent,
the bytes the table promises; every malformed compressed payload is a ProtocolError
naming what is wrong (the live server's replies: tests/test_psrv_fuzz.py).

Tier (c): `strategies.train --sync ps --servers 1`, a whole GPT at P = 2 workers, 30 steps,
one launch (GPT, lr 0.05, momentum 0.9: tests/test_parallel_runs.py).  The criteria and
what they measured here:

    fp8          final loss within 3 % of float32's push (measured 1e-5 relative); the
                 gradient bytes n + 4 a slice against 4n, a quarter +- 1 % (measured
                 0.25014: one 7104-element slice a step, its scale 4 bytes); every step's
                 loss equals fp8 over the ring's (FP8 all-gathers each rank's bytes and
                 sums them in float32, as the server does): rtol 1e-4 (measured 3e-7)
    topk:0.1     8 ceil(0.1 n) bytes a slice (the pairs); every loss equals top-k over the
                 ring's, rtol 1e-4 (the same pairs summed; measured equal), and after
                 20 steps within 2 % of float32's (measured 0.8 %); with
                 --momentum-correction (the velocity on the worker, the servers' SGD
                 without momentum) every loss equals the ring's too
    powersgd:2   4 r (rows + cols) bytes a slice of matrix_shape(n) (85 x 84 here:
                 1352 bytes, 4.8 % of float32's); after 20 steps within 12 % of float32's
                 loss (measured 9.8 %) and after 30 within 5 % (measured 3.0 %): a flat
                 slice seen as a near-square matrix has less low-rank structure than the
                 ring's per-weight matrices (ring, 20 steps: 1.9 %)
    hybrid       --sync hybrid --ranks-per-node 2, topk:0.1: the node's dense ring then
                 the leader's pairs; within 2 % of float32 after 20 steps

and a dp2 x pp2 grid through the servers with fp8: within 3 % of the whole model's
float32 loss after 20 steps, its bytes a quarter.  About 35 s on two busy cores.
"""
import json

import numpy as np
import pytest
import torch

import psrv.protocol as P
from conftest import check_ok, mpirun
from strategies.compression.fp8 import Fp8Compressor
from strategies.compression.powersgd import PowerSGDCompressor
from strategies.compression.topk import TopKCompressor
from strategies.config.compress_spec import topk_count
from strategies.sync.server_buckets import PushEncoder
from test_parallel_runs import GPT, SEVERAL
from test_ps_wire import GRID, PS

STEPS = 30


# ----------------------------------------------------------------- tier (a)
def gradient(n, seed=0):
    """Magnitudes over four decades, both signs, position-dependent: never all-ones."""
    i = torch.arange(n, dtype=torch.float32)
    return (torch.sin(i * 0.37 + seed) * 10.0 ** (i % 4 - 2)).numpy()


class Slice:
    """placement.Slice's fields that an encoder reads."""
    def __init__(self, key, length):
        self.key, self.name, self.offset, self.length, self.shape = key, "b0", 0, length, (length,)


def encoders():
    return {"fp8": PushEncoder("fp8", Fp8Compressor(None), P),
            "topk": PushEncoder("topk", TopKCompressor(0.1, None), P),
            "powersgd": PushEncoder("powersgd", PowerSGDCompressor(2), P)}


def push(entry_dtype, param, payload, length, key=3):
    parts = P.chunks(payload)
    entry = P.Entry(key, 0, length, (length,), dtype=entry_dtype, nframes=len(parts),
                    param=param)
    return P.encode(P.Op.PUSH_PULL, 1, 5, [entry], payload=parts)


def decoded(frames):
    """What the server sums: the dense float32 slice of the one entry."""
    msg = P.decode([bytes(memoryview(f).cast("B")) for f in frames])
    (entry, parts), = msg.entry_frames()
    return np.concatenate(P.to_float32(entry, parts))


def test_the_e4m3_table_is_torchs_cast():
    torchs = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(P.E4M3, torchs)       # NaN where torch's is NaN too


@pytest.mark.parametrize("length", [1001, 3, 300_000])
@pytest.mark.parametrize("kind", ["fp8", "topk", "powersgd"])
def test_a_compressed_push_decodes_to_what_the_worker_sent(kind, length):
    encode = encoders()[kind]
    g = gradient(length)
    code, param, payload = encode(Slice(3, length), g.copy())
    dense = decoded(push(code, param, payload, length))
    residual = encode.compressor.feedback.residual(3)
    if kind == "powersgd" and length == 3:        # 2 x 2 at rank 2: no gain, sent dense
        assert (code, residual) == (P.FLOAT32, None)
        np.testing.assert_array_equal(dense, g)
        return
    sent = g - residual.numpy()                   # error feedback: sent + e = g
    n, m = P.matrix_shape(length)
    nbytes = {"fp8": length + 4, "topk": 8 * topk_count(length, 0.1),
              "powersgd": 4 * 2 * (n + m)}[kind]
    assert payload.nbytes == nbytes
    if kind == "powersgd":      # P Qᵀ multiplied out by numpy and by torch: a few ulps
        np.testing.assert_allclose(dense, sent, rtol=1e-5, atol=1e-6 * np.abs(g).max())
    else:                       # the same float32 values, bit for bit
        np.testing.assert_array_equal(dense, sent)


def fp8_payload(length, scale):
    return P.compressed_payload(P.FP8, np.arange(length) % 120, scale)


def topk_payload(indices, values=None):
    values = np.ones(len(indices)) if values is None else values
    return P.compressed_payload(P.TOPK, indices, values)


L = 100               # matrix_shape(100) = (10, 10)
MALFORMED = [  # (what, frames, words in the ProtocolError)
    ("fp8 NaN scale", push(P.FP8, 0, fp8_payload(L, np.nan), L), "scale nan"),
    ("fp8 inf scale", push(P.FP8, 0, fp8_payload(L, np.inf), L), "scale inf"),
    ("fp8 zero scale", push(P.FP8, 0, fp8_payload(L, 0.0), L), "scale 0.0"),
    ("fp8 negative scale", push(P.FP8, 0, fp8_payload(L, -2.0), L), "scale -2.0"),
    ("fp8 no scale", push(P.FP8, 0, fp8_payload(L, 1.0)[:L], L), "100 payload bytes"),
    ("fp8 a byte short", push(P.FP8, 0, fp8_payload(L, 1.0)[1:], L), "103 payload bytes"),
    ("topk index past the slice", push(P.TOPK, 0, topk_payload([3, L]), L), "outside the slice"),
    ("topk negative index", push(P.TOPK, 0, topk_payload([-1, 5]), L), "outside the slice"),
    ("topk index twice", push(P.TOPK, 0, topk_payload([7, 9, 7]), L), "named twice"),
    ("topk more pairs than the slice", push(P.TOPK, 0, topk_payload(np.arange(L + 1) % L), L),
     "808 payload bytes"),
    ("topk half a pair", push(P.TOPK, 0, topk_payload([1, 2])[:12], L), "12 payload bytes"),
    ("powersgd rank 0", push(P.POWERSGD, 0, np.zeros(20, "<f4"), L), "rank 0 does not fit"),
    ("powersgd rank above the matrix", push(P.POWERSGD, 11, np.zeros(220, "<f4"), L),
     "rank 11 does not fit the 10 x 10 matrix"),
    ("powersgd factors of another rank", push(P.POWERSGD, 2, np.zeros(60, "<f4"), L),
     "240 payload bytes"),
    ("param on fp8", push(P.FP8, 2, fp8_payload(L, 1.0), L), "param 2 on dtype code 7"),
]


@pytest.mark.parametrize("what, frames, words", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_compressed_pushes_are_named(what, frames, words):
    with pytest.raises(P.ProtocolError, match=words):
        decoded(frames)


def test_a_compressed_entry_may_have_no_more_frames_than_its_largest_payload():
    # a slice of 2^20 elements: fp8's n + 4 bytes in 2 frames of 1 MiB, top-k's pairs in
    # at most 8 (k = n), PowerSGD's rank-2 factors of a 1024 x 1024 matrix in 1
    n = 1 << 20
    assert (P.most_frames(n, P.FP8), P.most_frames(n, P.TOPK),
            P.most_frames(n, P.POWERSGD, 2)) == (2, 8, 1)


# ----------------------------------------------------------------- tier (c)
def runs(tmp_path, nprocs, variants, steps=STEPS):
    """Each {name: flags} trained in one launch; {name: rank 0's step records}."""
    argvs = [[str(a) for a in GPT + ["--steps", steps, "--threads", "1", "--no-progress",
                                     "--jsonl", tmp_path / f"{name}.jsonl"] + flags]
             for name, flags in variants.items()]
    check_ok(mpirun(nprocs, SEVERAL + [json.dumps(argvs)], timeout=240))
    return {name: [r for r in map(json.loads, open(tmp_path / f"{name}.jsonl"))
                   if r["kind"] == "step" and r["rank"] == 0] for name in variants}


def losses(records):
    return np.array([r["loss"] for r in records])


def one_slice_a_step(records):
    """n, the elements of the one bucket (and slice) each step pushes."""
    assert {r["comm_rounds"] for r in records} == {1}, "one bucket a step"
    (dense,) = {r["dense_bytes"] for r in records}
    return dense // 4


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_fp8_topk_and_powersgd_pushes_train_with_the_bytes_they_promise(tmp_path):
    ps = runs(tmp_path, 3, {
        "none": PS, "fp8": PS + ["--compress", "fp8"], "topk": PS + ["--compress", "topk:0.1"],
        "powersgd": PS + ["--compress", "powersgd:2"],
        "topk_dgc": PS + ["--compress", "topk:0.1", "--momentum-correction"],
        "hybrid": ["--sync", "hybrid", "--servers", "1", "--ranks-per-node", "2",
                   "--compress", "topk:0.1"]})
    ring = runs(tmp_path, 2, {f"ring_{name}": ["--sync", "ring"] + flags for name, flags in (
        ("fp8", ["--compress", "fp8"]), ("topk", ["--compress", "topk:0.1"]),
        ("topk_dgc", ["--compress", "topk:0.1", "--momentum-correction"]))})
    none = losses(ps["none"])
    assert len(none) == STEPS
    n = one_slice_a_step(ps["none"])
    # fp8: a quarter of the bytes, the scale's 4 a slice beside them
    fp8 = ps["fp8"]
    assert abs(losses(fp8)[-1] - none[-1]) <= 0.03 * none[-1], (losses(fp8)[-1], none[-1])
    assert [r["wire_bytes"] for r in fp8] == [n + 4] * STEPS
    assert sum(r["wire_bytes"] for r in fp8) / sum(r["dense_bytes"] for r in fp8) == \
        pytest.approx(0.25, rel=0.01)
    np.testing.assert_allclose(losses(fp8), losses(ring["ring_fp8"]), rtol=1e-4)
    # top-k: the pairs, and the ring's run
    topk = ps["topk"]
    assert [r["wire_bytes"] for r in topk] == [8 * topk_count(n, 0.1)] * STEPS
    assert {r["kept_ratio"] for r in topk} == {0.1}
    np.testing.assert_allclose(losses(topk), losses(ring["ring_topk"]), rtol=1e-4)
    assert abs(losses(topk)[19] - none[19]) <= 0.02 * none[19], (losses(topk)[19], none[19])
    # DGC's momentum correction: the velocity on the worker, the servers' SGD without it
    np.testing.assert_allclose(losses(ps["topk_dgc"]), losses(ring["ring_topk_dgc"]), rtol=1e-4)
    # PowerSGD: the factors of the slice's matrix
    powersgd = losses(ps["powersgd"])
    rows, cols = P.matrix_shape(n)
    assert [r["wire_bytes"] for r in ps["powersgd"]] == [4 * 2 * (rows + cols)] * STEPS
    assert abs(powersgd[19] - none[19]) <= 0.12 * none[19], (powersgd[19], none[19])
    assert abs(powersgd[-1] - none[-1]) <= 0.05 * none[-1], (powersgd[-1], none[-1])
    # hybrid: the node's dense ring (4n handed to it), then the leader's pairs
    hybrid = ps["hybrid"]
    assert [r["wire_bytes"] for r in hybrid] == [4 * n + 8 * topk_count(n, 0.1)] * STEPS
    assert abs(losses(hybrid)[19] - none[19]) <= 0.02 * none[19], (losses(hybrid)[19], none[19])


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_fp8_pushes_on_a_dp2_pp2_grid(tmp_path):
    """Each stage's replicas push their own buckets in fp8; one process's float32 run is
    the reference (the grid through the servers equals it: test_parallel_runs)."""
    steps = 20
    plain = runs(tmp_path, 1, {"local": ["--sync", "local"]}, steps=steps)["local"]
    grid = runs(tmp_path, 5, {"grid_fp8": PS + GRID + ["--compress", "fp8"]},
                steps=steps)["grid_fp8"]
    assert abs(losses(grid)[-1] - losses(plain)[-1]) <= 0.03 * losses(plain)[-1]
    n = one_slice_a_step(grid)               # rank 0's stage: one bucket
    assert [r["wire_bytes"] for r in grid] == [n + 4] * steps
