"""Tier (c): the training worker under real mpiexec launches.

Equivalence is the integration test: P data-parallel ranks training k steps on
global batch B must reproduce one process (`--sync local`) training on B.

Tolerance: rtol = 1e-5, atol = 1e-6 on every loss and every final parameter.
The only difference allowed is the order of float32 additions: one process
averages B per-sample gradients at once; P ranks average B/P each, then the
collective sums P partial means (in ring, tree or pairwise order) and divides.
Each reordering changes a result by a few ulps (2^-24 ~ 6e-8 relative); over
5 SGD steps with momentum on a tiny MLP that stays below ~1e-7 (measured
1.5e-8 in absolute terms), so 1e-5 leaves a wide margin, while any real bug (a
rank's shard missing, a sum not averaged, a bucket out of place or a step
skipped) changes values by a factor like 1/P, far outside it.
"""
import json

import numpy as np
import pytest

from conftest import check_ok, mpirun

RTOL, ATOL = 1e-5, 1e-6
TINY = ["--model", "mlp", "--width", "32", "--depth", "2", "--in-dim", "8", "--classes", "4",
        "--dataset-size", "240", "--global-batch", "12", "--steps", "5", "--lr", "0.1",
        "--momentum", "0.9", "--bucket-mb", "0.004", "--threads", "1", "--no-progress"]
GPT = ["--model", "gpt", "--layers", "1", "--d-model", "16", "--heads", "2", "--vocab", "12",
       "--seq-len", "8", "--dataset-size", "120"]
TRAIN = ["-m", "strategies.train"]
# Several runs in one launch: `import torch` plus the torch._dynamo import that
# the first torch.optim optimizer triggers cost 5-15 s per process on two busy
# cores, far more than the runs themselves.  Each run is a full main(argv).
SEVERAL = ["-c", "import json, sys\nfrom strategies.train import main\n"
                 "for argv in json.loads(sys.argv[1]):\n    main(argv)"]


def train_several(tmp_path, nprocs, runs, timeout=150):
    """Launch once, train each (name, extra flags) in turn; returns {name: (records, params)}."""
    argvs = [[str(a) for a in TINY + list(extra) + ["--jsonl", tmp_path / f"{name}.jsonl",
                                                    "--params-out", tmp_path / f"{name}.npz"]]
             for name, extra in runs]
    check_ok(mpirun(nprocs, SEVERAL + [json.dumps(argvs)], timeout=timeout))
    return {name: (read_records(tmp_path / f"{name}.jsonl"), dict(np.load(tmp_path / f"{name}.npz")))
            for name, _ in runs}


def read_records(path):
    records = [json.loads(line) for line in open(path)]
    return [r for r in records if r["kind"] == "step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_several(tmp_path_factory.mktemp("local"), 1,
                         [("mlp", ["--sync", "local"]), ("gpt", ["--sync", "local"] + GPT)])


def assert_same_run(run, reference, nprocs):
    records, params = run
    ref_records, ref_params = reference
    ref_loss = [r["loss"] for r in ref_records]
    for rank in range(nprocs):
        mine = [r for r in records if r["rank"] == rank]
        assert [r["step"] for r in mine] == list(range(len(ref_loss)))
        np.testing.assert_allclose([r["loss"] for r in mine], ref_loss, rtol=RTOL, atol=ATOL)
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    for r in records:
        for field in ("step_time_s", "comm_time_s", "compute_time_s", "bytes_sent",
                      "bytes_received", "peak_mem_mb", "local_loss"):
            assert field in r


SYNCS = [("ring", []), ("tree", []), ("halving_doubling", []),
         ("hierarchical", ["--ranks-per-node", "2"]),   # P=3: nodes of 2 and 1 ranks
         ("mpi", []), ("torch", [])]


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nprocs", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_allreduce_syncs_reproduce_one_process(tmp_path, reference, nprocs):
    runs = [(sync, ["--sync", sync] + extra) for sync, extra in SYNCS]
    if nprocs == 2:   # the GPT without overlap, and fp16 on the wire
        runs += [("gpt_no_overlap", ["--sync", "ring", "--no-overlap"] + GPT),
                 ("fp16", ["--sync", "ring", "--compress", "fp16"])]
    got = train_several(tmp_path, nprocs, runs, timeout=230)
    failures = []
    for sync, _ in SYNCS:
        try:
            assert_same_run(got[sync], reference["mlp"], nprocs)
        except AssertionError as e:
            failures.append(f"--sync {sync}: {e}")
        if sync in ("ring", "tree", "halving_doubling"):
            assert all(r["bytes_sent"] > 0 for r in got[sync][0])
        if sync in ("mpi", "torch"):             # the library's traffic is not observable
            assert all(r["bytes_sent"] is None for r in got[sync][0])
    assert not failures, "\n".join(failures)
    if nprocs == 2:
        assert_same_run(got["gpt_no_overlap"], reference["gpt"], 2)
        records, params = got["fp16"]
        # fp16 keeps 11 significant bits: about 1e-3 relative per gradient, not 1e-7
        np.testing.assert_allclose([r["loss"] for r in records if r["rank"] == 0],
                                   [r["loss"] for r in reference["mlp"][0]], rtol=1e-2)
        assert max(r["bytes_sent"] for r in records) < \
            0.6 * min(r["bytes_sent"] for r in got["ring"][0])


# --compress of the resume tests: each lossy one keeps state from step to step
RESUMED_COMPRESS = ("none", "topk:0.1", "powersgd:2")
# a launch's runs that must each be refused: every rank's (exit code, stderr) as one
# JSON line from rank 0, for refusals_of
REFUSE = ["-c", "import contextlib, io, json, sys\nfrom mpi4py import MPI\n"
                "from strategies.train import main\n"
                "for argv in json.loads(sys.argv[1]):\n"
                "    err = io.StringIO()\n"
                "    with contextlib.redirect_stderr(err):\n"
                "        try:\n            main(argv)\n            code = 0\n"
                "        except SystemExit as e:\n            code = e.code\n"
                "    said = MPI.COMM_WORLD.gather((code, err.getvalue()))\n"
                "    if MPI.COMM_WORLD.rank == 0:\n        print(json.dumps(said))\n"]


def refusals_of(nprocs, argvs, timeout=90):
    """[[(exit code, stderr) of each rank] of each argv], all trained in one launch."""
    argvs = [[str(a) for a in TINY + list(argv)] for argv in argvs]
    result = check_ok(mpirun(nprocs, REFUSE + [json.dumps(argvs)], timeout=timeout))
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("[[")]


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_resumed_run_reproduces_the_uninterrupted_run(tmp_path):
    """Stopped at step 3, resumed to 6: the run that never stopped, bit for bit (same P,
    same order of additions), also through top-k and PowerSGD, whose state (each rank's
    residuals, PowerSGD's warm-start Q) each rank's file carries.  A resume with another
    --compress is refused on every rank, exit 2, naming both: within the split layout
    of a lossy compression and across layouts (a whole run's checkpoint.pt)."""
    runs, ckpt = [], {}
    for compress in RESUMED_COMPRESS:
        name = compress.replace(":", "")
        common = ["--sync", "ring", "--optimizer", "adam", "--lr", "0.01", "--steps", "6",
                  "--compress", compress]
        ckpt[compress] = ["--checkpoint-dir", tmp_path / f"ckpt_{name}"]
        runs += [(f"whole_{name}", common),
                 (f"first_{name}", common + ckpt[compress] + ["--steps", "3",
                                                              "--checkpoint-every", "2"]),
                 (f"rest_{name}", common + ckpt[compress] + ["--resume"])]
    got = train_several(tmp_path, 2, runs, timeout=230)
    for compress in RESUMED_COMPRESS:
        name = compress.replace(":", "")
        records, params = got[f"rest_{name}"]
        assert sorted({r["step"] for r in records}) == [3, 4, 5]
        whole_records, whole_params = got[f"whole_{name}"]
        for r in records:                               # bit for bit: same P, same order
            assert r["loss"] == next(w["loss"] for w in whole_records
                                     if w["step"] == r["step"] and w["rank"] == r["rank"]), \
                (compress, r["step"])
        for key, value in whole_params.items():
            np.testing.assert_array_equal(params[key], value, err_msg=f"{compress} {key}")
    resume = ["--sync", "ring", "--steps", "6", "--resume"]
    said = refusals_of(2, [resume + ["--compress", "powersgd:2"] + ckpt["topk:0.1"],
                           resume + ["--compress", "topk:0.1"] + ckpt["none"],
                           resume + ckpt["powersgd:2"]])
    assert len(said) == 3, said
    for ranks, (theirs, ours) in zip(said, [("topk:0.1", "powersgd:2"), ("none", "topk:0.1"),
                                           ("powersgd:2", "none")]):
        for rank, (code, err) in enumerate(ranks):
            line = next((l for l in err.splitlines()
                         if l.startswith(f"strategies.train rank {rank}: error:")), "")
            assert code == 2 and f"compress {theirs};" in line and \
                f"this run is " in line and f"compress {ours} " in line, err


def failing(nprocs, args, timeout=60):
    result = mpirun(nprocs, TRAIN + TINY + list(args), timeout=timeout)
    assert result.returncode != 0, result.stdout
    return result.stderr


def assert_every_rank_says(stderr, nprocs, message):
    for rank in range(nprocs):
        line = next((l for l in stderr.splitlines()
                     if l.startswith(f"strategies.train rank {rank}: error:")), None)
        assert line is not None, f"rank {rank} reported nothing:\n{stderr[-3000:]}"
        assert message in line, line


@pytest.mark.mpi
@pytest.mark.timeout(90)
@pytest.mark.parametrize("args, message", [
    (["--sync", "rign"], "--sync 'rign' is not one of"),
    (["--model", "cnn"], "--model 'cnn' is not one of"),
    (["--sync", "ring", "--global-batch", "13"], "13 % dp(2) = 1"),
], ids=["sync", "model", "batch"])
def test_bad_flags_fail_on_every_rank(args, message):
    assert_every_rank_says(failing(2, args), 2, message)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_wrong_data_file_fails_on_every_rank(tmp_path):
    bad = tmp_path / "labels_as_floats.npz"
    np.savez(bad, x=np.zeros((12, 8), np.float32), y=np.zeros(12, np.float32))
    assert_every_rank_says(failing(3, ["--sync", "tree", "--data", bad]), 3,
                           "y must be (N,) integer labels")


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_resume_from_another_model_or_world_fails_on_every_rank(tmp_path):
    ckpt = ["--checkpoint-dir", tmp_path / "ckpt"]
    check_ok(mpirun(2, TRAIN + TINY + ["--sync", "ring", "--steps", "2"] + ckpt))
    stderr = failing(2, ["--sync", "ring", "--width", "16", "--resume"] + ckpt)
    assert_every_rank_says(stderr, 2, "holds another model")
    stderr = failing(3, ["--sync", "ring", "--resume"] + ckpt)
    assert_every_rank_says(stderr, 3, "written by world 2 = dp(2), this run is world 3 = dp(3)")


# ----------------------------------------------------------- parameter servers
ASYNC = {"asp": ["--consistency", "asp"], "ssp": ["--consistency", "ssp", "--staleness", "2"]}


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_parameter_server_syncs(tmp_path, reference, nprocs):
    """P = nprocs - 1 workers (2 and 3) and one server.  BSP ps and hybrid must
    reproduce one process; hybrid has one node of 2 workers at P=2 and three
    nodes of 1 at P=3, so both halves (ring inside, servers between) are used.
    At P=2, ASP and SSP (with stale gradients, so no equivalence) must converge."""
    per_node = "2" if nprocs == 3 else "1"
    runs = [("ps", ["--sync", "ps", "--servers", "1"]),
            ("hybrid", ["--sync", "hybrid", "--servers", "1", "--ranks-per-node", per_node])]
    if nprocs == 3:
        runs += [(name, ["--sync", "ps", "--servers", "1", "--steps", "60", "--momentum", "0",
                         "--lr", "0.2"] + flags) for name, flags in ASYNC.items()]
        adam = ["--sync", "ps", "--servers", "1", "--optimizer", "adam", "--lr", "0.01",
                "--steps", "6"]
        ckpt = ["--checkpoint-dir", tmp_path / "ckpt"]
        runs += [("ps_whole", adam), ("ps_first", adam + ckpt + ["--steps", "3",
                                                                 "--checkpoint-every", "2"]),
                 ("ps_rest", adam + ckpt + ["--resume"])]
        hybrid = ["--sync", "hybrid", "--servers", "1", "--ranks-per-node", "2"] + adam[4:]
        hckpt = ["--checkpoint-dir", tmp_path / "hybrid_ckpt"]
        runs += [("hybrid_whole", hybrid),
                 ("hybrid_first", hybrid + hckpt + ["--steps", "3", "--checkpoint-every", "2"]),
                 ("hybrid_rest", hybrid + hckpt + ["--resume"])]
        # top-k on the pushes: each worker's residuals are in its own file
        topk = adam + ["--compress", "topk:0.1"]
        tckpt = ["--checkpoint-dir", tmp_path / "topk_ckpt"]
        runs += [("ps_topk_whole", topk),
                 ("ps_topk_first", topk + tckpt + ["--steps", "3", "--checkpoint-every", "2"]),
                 ("ps_topk_rest", topk + tckpt + ["--resume"])]
    got = train_several(tmp_path, nprocs, runs, timeout=280)
    for sync in ("ps", "hybrid"):
        assert_same_run(got[sync], reference["mlp"], nprocs - 1)
        assert all(r["bytes_sent"] > 0 for r in got[sync][0])
    for kind in ("ps", "hybrid", "ps_topk") if nprocs == 3 else ():
        # the servers saved and reloaded their shards (Adam moments included), and
        # under top-k each worker its residuals
        records, params = got[f"{kind}_rest"]
        assert sorted({r["step"] for r in records}) == [3, 4, 5], kind
        whole_records, whole_params = got[f"{kind}_whole"]
        np.testing.assert_allclose([r["loss"] for r in records if r["rank"] == 0],
                                   [r["loss"] for r in whole_records
                                    if r["rank"] == 0 and r["step"] >= 3], rtol=RTOL, atol=ATOL,
                                   err_msg=kind)
        for name, value in whole_params.items():
            np.testing.assert_allclose(params[name], value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{kind} {name}")
    if nprocs == 3:       # two workers: a server's sum of two pushes is the same in
        for name, value in got["ps_topk_whole"][1].items():     # either order: bit for bit
            np.testing.assert_array_equal(got["ps_topk_rest"][1][name], value, err_msg=name)
    for name in ASYNC if nprocs == 3 else ():
        loss = [r["loss"] for r in got[name][0] if r["rank"] == 0]
        assert len(loss) == 60
        assert np.mean(loss[-10:]) < 0.8 * np.mean(loss[:5]), (name, loss)
