"""Tier (c) for the grid: ZeRO, tensor and pipeline parallelism under real mpiexec launches.

Equivalence: every split trains the same model on the same global batch as
`--sync local` on one process, k = 3 steps; losses and final parameters
(reassembled from the stages, tp shards and ZeRO shards) must agree.

Tolerance: rtol = 1e-5, atol = 1e-6, as for the plain data-parallel worker
(tests/test_train_runs.py), and for the same reason: only the order of float
additions changes.  Here the reorderings are: the dp average of partial means;
the row-parallel layer's sum of tp partial products (g); f's sum of the tp
ranks' input gradients; the sum of micro-batch gradients, each scaled by its
share of the batch.  Each changes a result by a few ulps (6e-8 relative);
measured differences after 3 steps are <= 3e-8 absolute, while a real bug (a
missing shard, a micro-batch counted twice, a head on the wrong rank) moves
values by O(lr * grad) ~ 1e-3.

Adam runs use the MLP only.  In the GPT, the attention's key bias has a
gradient that is exactly zero in real arithmetic (softmax ignores a constant
added to a query's scores), so its float gradient is rounding noise ~1e-9,
which Adam's g / sqrt(v) blows up to +-lr: any reordering flips it.  ZeRO's
sharded Adam on the GPT is still checked, bit for bit, against plain data
parallelism in the same run (zero 0), whose reorderings are the same.
"""
import json

import numpy as np
import pytest

from conftest import check_ok, mpirun, torchrun
from strategies.parallel.context_parallel import context_bytes

RTOL, ATOL = 1e-5, 1e-6
COMMON = ["--steps", "3", "--threads", "1", "--no-progress", "--sync", "ring"]
GPT = ["--model", "gpt", "--layers", "2", "--d-model", "16", "--heads", "2", "--vocab", "12",
       "--seq-len", "8", "--dataset-size", "120", "--global-batch", "8", "--lr", "0.05",
       "--momentum", "0.9"]
MLP_ADAM = ["--model", "mlp", "--width", "24", "--depth", "2", "--in-dim", "8", "--classes", "4",
            "--dataset-size", "120", "--global-batch", "12", "--optimizer", "adam", "--lr", "0.01"]
MLP_SGD = MLP_ADAM[:-4] + ["--momentum", "0.9", "--lr", "0.05"]
# One launch trains several runs in turn: importing torch costs 5-15 s per
# process on two busy cores, far more than these runs.  Bad input exits
# (SystemExit 2) are caught so that the next run of the launch goes on.
SEVERAL = ["-c", "import json, sys\nfrom strategies.train import main\n"
                 "for argv in json.loads(sys.argv[1]):\n"
                 "    try:\n        main(argv)\n"
                 "    except SystemExit as e:\n        sys.stdout.write(f'exit {e.code}\\n')"]


def launch(tmp_path, nprocs, runs, timeout=200, then="", expect="", common=COMMON,
           launcher=mpirun, **env):
    """Train each (name, flags) in one launch; {name: (step records, parameters)}.
    `then`: Python run after the runs in the same launch; `expect`: text its output holds;
    `common`: the flags every run shares; `launcher`: conftest's mpirun or torchrun."""
    argvs = [[str(a) for a in common + flags] + ["--jsonl", str(tmp_path / f"{name}.jsonl"),
                                                 "--params-out", str(tmp_path / f"{name}.npz")]
             for name, flags in runs]
    script = [SEVERAL[0], SEVERAL[1] + then]
    result = check_ok(launcher(nprocs, script + [json.dumps(argvs)], timeout=timeout, **env))
    assert expect in result.stdout, result.stdout[-2000:]
    out = {}
    for name, _ in runs:
        records = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
        out[name] = ([r for r in records if r["kind"] == "step"],
                     dict(np.load(tmp_path / f"{name}.npz")))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("reference"), 1,
                  [("gpt", GPT + ["--sync", "local"]), ("mlp_adam", MLP_ADAM + ["--sync", "local"]),
                   ("mlp_sgd", MLP_SGD + ["--sync", "local"])])


def assert_same_run(run, ref, world, rtol=RTOL):
    (records, params), (ref_records, ref_params) = run, ref
    ref_loss = [r["loss"] for r in ref_records]
    for rank in range(world):
        mine = [r for r in records if r["rank"] == rank]
        assert [r["step"] for r in mine] == list(range(len(ref_loss)))
        np.testing.assert_allclose([r["loss"] for r in mine], ref_loss, rtol=rtol, atol=ATOL)
    assert sorted(params) == sorted(ref_params)
    for name in ref_params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=rtol, atol=ATOL,
                                   err_msg=name)


TWO = [
    ("zero1", GPT + ["--zero", "1"]),
    ("zero2", GPT + ["--zero", "2"]),
    ("zero3", GPT + ["--zero", "3"]),
    ("zero3_micro", GPT + ["--zero", "3", "--micro-batches", "2"]),
    ("tp2", GPT + ["--tp", "2"]),
    ("pp2_gpipe", GPT + ["--pp", "2", "--micro-batches", "4", "--schedule", "gpipe"]),
    ("pp2_1f1b", GPT + ["--pp", "2", "--micro-batches", "3", "--schedule", "1f1b"]),
    # ZeRO and tp over other all-reduce backends of allreduce/ (ring is the default above)
    ("zero3_tree", GPT + ["--zero", "3", "--sync", "tree"]),
    ("zero2_mpi", GPT + ["--zero", "2", "--sync", "mpi"]),
    ("zero1_hierarchical", GPT + ["--zero", "1", "--sync", "hierarchical"]),
    ("tp2_halving_doubling", GPT + ["--tp", "2", "--sync", "halving_doubling"]),
    ("adam_zero0", MLP_ADAM + ["--dp", "2"]),
    ("adam_zero1", MLP_ADAM + ["--zero", "1"]),
    ("adam_zero2", MLP_ADAM + ["--zero", "2"]),
    ("adam_zero3", MLP_ADAM + ["--zero", "3"]),
]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("two"), 2, TWO)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [n for n, _ in TWO])
def test_two_ranks_reproduce_one_process(two, reference, name):
    assert_same_run(two[name], reference["mlp_adam" if "adam" in name else "gpt"], 2)


FOUR = [
    ("dp2_tp2", GPT + ["--dp", "2", "--tp", "2"]),
    ("dp2_pp2", GPT + ["--dp", "2", "--pp", "2", "--micro-batches", "2"]),
    ("pp2_tp2", GPT + ["--pp", "2", "--tp", "2", "--micro-batches", "2", "--schedule", "gpipe"]),
    ("zero1_tp2", GPT + ["--tp", "2", "--zero", "1"]),
    ("zero2_tp2", GPT + ["--tp", "2", "--zero", "2"]),
    ("zero3_tp2", GPT + ["--tp", "2", "--zero", "3"]),
    ("zero3_pp2", GPT + ["--pp", "2", "--zero", "3", "--micro-batches", "2"]),
    # sequence parallelism: the stages pass sequence shards; dp replicas of a tp pair
    ("pp2_tp2_sp", GPT + ["--pp", "2", "--tp", "2", "--micro-batches", "2",
                          "--sequence-parallel"]),
    ("dp2_tp2_sp", GPT + ["--dp", "2", "--tp", "2", "--sequence-parallel"]),
]


# The parameter servers on the grid: 4 workers and 1 server.  Each bucket of a stage's
# (or a tp piece's) layers is pushed under a key of its own, and the server averages it
# over that key's dp replicas (sync/server_buckets.py); the hybrid all-reduces it inside
# a node of dp replicas first.  Same tolerance as above: the server's SGD is torch's,
# in float32, and only the order of additions changes.
SERVERS = [
    ("ps_dp2_pp2", GPT + ["--sync", "ps", "--servers", "1", "--dp", "2", "--pp", "2",
                          "--micro-batches", "2"]),
    ("ps_dp2_tp2", GPT + ["--sync", "ps", "--servers", "1", "--dp", "2", "--tp", "2"]),
    ("hybrid_dp2_pp2", GPT + ["--sync", "hybrid", "--servers", "1", "--ranks-per-node", "2",
                              "--dp", "2", "--pp", "2", "--micro-batches", "2"]),
    # the MLP's stages replay their layers (parallel/recompute.py's of_blocks)
    ("ps_mlp_recompute_dp2_pp2", MLP_SGD + ["--sync", "ps", "--servers", "1", "--dp", "2",
                                            "--pp", "2", "--micro-batches", "2",
                                            "--recompute"]),
]


@pytest.mark.timeout(300)
def test_parameter_servers_on_the_grid_reproduce_one_process(tmp_path, reference):
    runs = launch(tmp_path, 5, SERVERS, timeout=240)
    for name, _ in SERVERS:
        assert_same_run(runs[name], reference["mlp_sgd" if "mlp" in name else "gpt"], 4)


@pytest.mark.timeout(300)
def test_parameter_servers_on_the_grid_resume_exactly(tmp_path):
    """Stopped at step 4 (the servers' shards and the workers' set of step 4), resumed
    to 6: the parameters of the run that never stopped, bit for bit."""
    ps = GPT + SERVERS[0][1][len(GPT):] + ["--checkpoint-dir", str(tmp_path / "ckpt"),
                                           "--checkpoint-every", "2"]
    runs = launch(tmp_path, 5, [("whole", SERVERS[0][1] + ["--steps", "6"]),
                                ("first", ps + ["--steps", "4"]),
                                ("resumed", ps + ["--steps", "6", "--resume"])])
    for name in runs["whole"][1]:
        np.testing.assert_array_equal(runs["resumed"][1][name], runs["whole"][1][name],
                                      err_msg=name)


# Today's shapes on an uneven pipeline: 7 blocks on 3 stages (the balanced split is
# 2, 3, 2: the embedding and the head weigh on the ends), grouped-query attention (4
# query heads over 2 key-value heads) and a SwiGLU MLP of its own width.
UNEVEN = ["--model", "gpt", "--layers", "7", "--d-model", "16", "--heads", "4",
          "--kv-heads", "2", "--ffn-hidden", "24", "--gated-mlp", "--vocab", "12",
          "--seq-len", "8", "--dataset-size", "120", "--global-batch", "8", "--lr", "0.05",
          "--momentum", "0.9"]
UNEVEN_RTOL = 1e-4     # 3 steps; seven blocks and SwiGLU's products add more reorderings


@pytest.mark.timeout(400)
def test_uneven_stages_with_today_shapes_reproduce_one_process_and_resume(tmp_path):
    """dp2 x pp3 on 6 ranks against one process on the global batch, 3 steps, rtol 1e-4;
    then stopped at step 2 and resumed to 3: the uninterrupted run's parameters, bit for
    bit.  The first part runs the balanced split, the resumed part names it by hand
    (--pp-layers 2,3,2): the same split, so the same layout."""
    one = launch(tmp_path, 1, [("one", UNEVEN + ["--sync", "local"])])["one"]
    grid = ["--dp", "2", "--pp", "3", "--micro-batches", "2"]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    runs = launch(tmp_path, 6, [("whole", UNEVEN + grid),
                                ("first", UNEVEN + grid + ckpt + ["--steps", "2"]),
                                ("resumed", UNEVEN + grid + ckpt + ["--steps", "3", "--resume",
                                                                    "--pp-layers", "2,3,2"])],
                  timeout=300)
    config = next(json.loads(line) for line in open(tmp_path / "whole.jsonl")
                  if json.loads(line)["kind"] == "config")
    assert config["pp_layers"] == "2,3,2"           # the balanced split, recorded
    records, params = runs["whole"]
    ref_records, ref_params = one
    for rank in range(6):
        losses = [r["loss"] for r in records if r["rank"] == rank]
        np.testing.assert_allclose(losses, [r["loss"] for r in ref_records], rtol=UNEVEN_RTOL)
    assert sorted(params) == sorted(ref_params)
    for name in ref_params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=UNEVEN_RTOL,
                                   atol=1e-6, err_msg=name)
    assert {r["step"] for r in runs["resumed"][0]} == {2}          # it went on from step 2
    for name in params:
        np.testing.assert_array_equal(runs["resumed"][1][name], params[name], err_msg=name)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_four_ranks_combinations_reproduce_one_process(tmp_path, reference):
    runs = launch(tmp_path, 4, FOUR, timeout=300)
    for name, _ in FOUR:
        assert_same_run(runs[name], reference["gpt"], 4)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_zero_on_three_ranks_uneven_shards(tmp_path, reference):
    """dp = 3 (odd on purpose): every layer's flat buffer splits unevenly.  SGD with
    momentum (a sharded optimizer state) against one process; Adam against plain data
    parallelism on the same 3 ranks, whose gradients are reduced in the same ring order
    (a bucket a layer at every stage, as stage 3 has, by a cap below any layer), so
    sharding the optimizer must change nothing at all (Adam amplifies the rounding
    of near-zero gradients too much for a comparison with one process at dp = 3)."""
    runs = launch(tmp_path, 3, [(f"sgd{s}", MLP_SGD + ["--zero", str(s)]) for s in (1, 2, 3)] +
                  [(f"adam{s}", MLP_ADAM + ["--zero", str(s), "--dp", "3", "--bucket-mb", "1e-6"])
                   for s in (0, 1, 2, 3)])
    for s in (1, 2, 3):
        assert_same_run(runs[f"sgd{s}"], reference["mlp_sgd"], 3)
        for name, value in runs["adam0"][1].items():
            np.testing.assert_array_equal(runs[f"adam{s}"][1][name], value, err_msg=name)


# Context parallelism: a GPT at seq 64 (each cp rank holds 32 positions of every
# sequence), fp32, 3 steps, against one process on the global batch.  Tolerance rtol
# 1e-4: on top of the reorderings above, the ring's online softmax adds its blocks'
# exponentials in another order than one softmax over the row, and Ulysses' and the
# ring's attention is computed in pieces; measured differences are ~5e-8 on the loss
# and ~5e-6 relative on the parameters, a real bug (a slice at the wrong position, a
# block skipped, gradients averaged over dp only) moves them by O(lr * grad) ~ 1e-3.
CP_RTOL = 1e-4
CP_SEQ = 64
CP_GPT = GPT[:GPT.index("--seq-len")] + ["--seq-len", str(CP_SEQ)] + \
    GPT[GPT.index("--seq-len") + 2:]
CP_TWO = [("cp2_ring", CP_GPT + ["--cp", "2", "--cp-kind", "ring"]),
          ("cp2_ulysses", CP_GPT + ["--cp", "2", "--cp-kind", "ulysses"]),
          # rank 0 holds positions 0-15 and 48-63, rank 1 16-47 (context_order.py)
          ("cp2_ring_zigzag", CP_GPT + ["--cp", "2", "--cp-kind", "ring",
                                        "--cp-order", "zigzag"]),
          ("cp2_ulysses_zigzag", CP_GPT + ["--cp", "2", "--cp-kind", "ulysses",
                                           "--cp-order", "zigzag"])]
# interleaved needs pp x virtual stages = 4 blocks, against a reference of its own
CP_GPT4 = CP_GPT[:CP_GPT.index("--layers")] + ["--layers", "4"] + \
    CP_GPT[CP_GPT.index("--layers") + 2:]
CP_FOUR = [("cp2_tp2", CP_GPT + ["--cp", "2", "--tp", "2"]),
           ("cp2_dp2_zero1", CP_GPT + ["--cp", "2", "--dp", "2", "--zero", "1"]),
           # each stage's rank sends the next stage its slice of the positions
           ("cp2_pp2", CP_GPT + ["--cp", "2", "--pp", "2", "--micro-batches", "2",
                                 "--schedule", "1f1b"]),
           ("cp2_pp2_ulysses_interleaved", CP_GPT4 + [
               "--cp", "2", "--cp-kind", "ulysses", "--pp", "2", "--micro-batches", "2",
               "--schedule", "interleaved", "--virtual-stages", "2"]),
           # tp's sequence-parallel shards cut each cp rank's slice: 16 positions a rank
           ("cp2_tp2_sp", CP_GPT + ["--cp", "2", "--tp", "2", "--sequence-parallel"]),
           # the zig-zag chunks through a pipeline's stages and tp's shards
           ("cp2_pp2_zigzag", CP_GPT + ["--cp", "2", "--pp", "2", "--micro-batches", "2",
                                        "--cp-order", "zigzag"]),
           ("cp2_tp2_sp_zigzag", CP_GPT + ["--cp", "2", "--tp", "2", "--sequence-parallel",
                                           "--cp-order", "zigzag"])]


@pytest.fixture(scope="module")
def context_runs(tmp_path_factory):
    """{name: (records, parameters)} of the one-process reference and the cp runs."""
    folder = tmp_path_factory.mktemp("context")
    return {**launch(folder, 1, [("one", CP_GPT + ["--sync", "local"]),
                                 ("one4", CP_GPT4 + ["--sync", "local"])]),
            **launch(folder, 2, CP_TWO), **launch(folder, 4, CP_FOUR, timeout=300)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, world", [(n, 2) for n, _ in CP_TWO] +
                         [(n, 4) for n, _ in CP_FOUR])
def test_cp_reproduces_one_process(context_runs, name, world):
    reference = context_runs["one4" if "interleaved" in name else "one"]
    (records, params), (ref_records, ref_params) = context_runs[name], reference
    ref_loss = [r["loss"] for r in ref_records]
    for rank in range(world):
        mine = [r for r in records if r["rank"] == rank]
        assert [r["step"] for r in mine] == list(range(3))
        np.testing.assert_allclose([r["loss"] for r in mine], ref_loss, rtol=CP_RTOL)
    assert sorted(params) == sorted(ref_params)
    for key in ref_params:
        np.testing.assert_allclose(params[key], ref_params[key], rtol=CP_RTOL, atol=1e-6,
                                   err_msg=key)


# The splits under torchrun, which starts no MPI: the mesh's axes are torch process
# groups (allreduce/torch_comm.py), the pipeline's activations and the cp ring's blocks
# travel over gloo's point-to-point, the collectives are torch.distributed's (--sync
# torch).  The same reorderings as under mpiexec, so the same tolerances: RTOL for the
# GPT's splits, CP_RTOL for the ring's online softmax.  On 2 processes each split's axis
# is the whole world; on 4, dp x pp and cp x pp cut it into two groups an axis.
TORCHRUN_TWO = [
    ("pp2", GPT + ["--pp", "2", "--micro-batches", "2"]),
    ("tp2", GPT + ["--tp", "2"]),
    ("dp2_zero1", GPT + ["--dp", "2", "--zero", "1"]),
    ("cp2_ring", CP_GPT + ["--cp", "2", "--cp-kind", "ring"]),
]
TORCHRUN_FOUR = [("dp2_pp2", GPT + ["--dp", "2", "--pp", "2", "--micro-batches", "2"]),
                 ("cp2_pp2", CP_GPT + ["--cp", "2", "--pp", "2", "--micro-batches", "2"])]


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory):
    """({name: (records, parameters)} of the one-process references, of the torchrun
    runs): each list of runs in one torchrun launch."""
    folder = tmp_path_factory.mktemp("torchrun")
    one = launch(folder, 1, [("gpt", GPT + ["--sync", "local"]),
                             ("cp", CP_GPT + ["--sync", "local"])])
    torch_sync = COMMON[:-2] + ["--sync", "torch"]
    runs = {**launch(folder, 2, TORCHRUN_TWO, common=torch_sync, launcher=torchrun),
            **launch(folder, 4, TORCHRUN_FOUR, common=torch_sync, launcher=torchrun)}
    return one, runs


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name, world", [(n, 2) for n, _ in TORCHRUN_TWO] +
                         [(n, 4) for n, _ in TORCHRUN_FOUR])
def test_splits_under_torchrun_reproduce_one_process(torchrun_runs, name, world):
    one, runs = torchrun_runs
    assert_same_run(runs[name], one["cp" if name.startswith("cp") else "gpt"], world,
                    rtol=CP_RTOL if name.startswith("cp") else RTOL)


# Context parallelism through the parameter servers: a key's group is its dp x cp
# replicas (sync/server_buckets.py), so BSP averages each bucket over both, and the
# hybrid's nodes are made of those replicas (two nodes of a context group each
# below).  2 workers + 1 server, then 4 + 1; the server's SGD is torch's, in float32.
PS = ["--sync", "ps", "--servers", "1", "--consistency", "bsp"]
CP_SERVERS_TWO = [("ps_cp2_ring", CP_GPT + PS + ["--cp", "2", "--cp-kind", "ring"]),
                  ("ps_cp2_ulysses", CP_GPT + PS + ["--cp", "2", "--cp-kind", "ulysses"])]
CP_SERVERS_FOUR = [("ps_cp2_dp2", CP_GPT + PS + ["--cp", "2", "--dp", "2"]),
                   ("hybrid_cp2_dp2", CP_GPT + ["--sync", "hybrid", "--servers", "1",
                                                "--ranks-per-node", "2", "--cp", "2",
                                                "--dp", "2"])]


@pytest.mark.timeout(600)
def test_cp_through_the_parameter_servers_reproduces_one_process(context_runs, tmp_path):
    runs = {**launch(tmp_path, 3, CP_SERVERS_TWO, timeout=240),
            **launch(tmp_path, 5, CP_SERVERS_FOUR, timeout=300)}
    for name, _ in CP_SERVERS_TWO:
        assert_same_run(runs[name], context_runs["one"], 2, rtol=CP_RTOL)
    for name, _ in CP_SERVERS_FOUR:
        assert_same_run(runs[name], context_runs["one"], 4, rtol=CP_RTOL)


def refused(common, flags):
    """`then` code for launch: train `flags` once more on every rank, and print what
    rank 0 wrote to stderr (a refusal's line) to stdout, for launch's `expect`."""
    argv = [str(a) for a in common + flags]
    return ("\nimport contextlib, io\nfrom mpi4py import MPI\nerr = io.StringIO()\n"
            "with contextlib.redirect_stderr(err):\n    try:\n"
            f"        main({argv!r})\n    except SystemExit:\n        pass\n"
            "if MPI.COMM_WORLD.rank == 0:\n    print(err.getvalue())\n")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world, split, other, says", [
    # the whole model: the first replica alone writes checkpoint.pt
    (2, ["--cp", "2"], [],
     "was written by world 2 = dp(1) x cp(2), this run is world 2 = dp(2)"),
    # a set of rank files: each cp rank its own ZeRO shard, its coordinates its cp rank
    (4, ["--cp", "2", "--dp", "2", "--zero", "1"], ["--dp", "4", "--zero", "1"],
     "is a set of a run of world 4, dp 2, cp 2; this run is world 4, dp 4"),
])
def test_cp_resumes_exactly(tmp_path, world, split, other, says):
    """Saved at step 2, resumed to step 4: the uninterrupted run's parameters, bit for
    bit; the same checkpoint resumed in another layout is refused, naming both."""
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    runs = launch(tmp_path, world, [("whole", CP_GPT + split + ["--steps", "4"]),
                                    ("first", CP_GPT + split + ckpt + ["--steps", "2"]),
                                    ("resumed", CP_GPT + split + ckpt +
                                     ["--steps", "4", "--resume"])],
                  timeout=400, then=refused(COMMON, CP_GPT + other + ckpt +
                                            ["--steps", "4", "--resume"]), expect=says)
    assert {r["step"] for r in runs["resumed"][0]} == {2, 3}       # it went on from step 2
    for name, value in runs["whole"][1].items():
        np.testing.assert_array_equal(runs["resumed"][1][name], value, err_msg=name)


@pytest.mark.timeout(600)
def test_cp_bytes_match_the_formulas(context_runs):
    """What the attention cores send a step, on every rank, against ring_bytes (2 (cp-1)
    key-value blocks a layer forward; again, and the gradients' 2 cp, backward) and
    ulysses_bytes (the packed q k v all-to-all and the output's, forward and backward):
    a local batch of 8 / dp sequences, d_model / tp features a rank's attention holds,
    the blocks of its pipeline stage (1 of 2; 2 of 4 interleaved).  Within 1 % a
    micro-batch: the TOPOLAB_CHECK exchange that conftest switches on sends signatures
    (48 bytes a rank, and the table back from the group's rank 0) before each of
    Ulysses' all-to-alls, 0.3 to 0.6 % of a step here, and a pipeline makes those calls
    once a micro-batch; the ring's point-to-point messages are not checked."""
    layers, d_model, batch = 2, 16, 8
    shapes = {"cp2_ring": ("ring", batch, d_model, layers, 1),
              "cp2_ulysses": ("ulysses", batch, d_model, layers, 1),
              "cp2_ring_zigzag": ("ring", batch, d_model, layers, 1),
              "cp2_ulysses_zigzag": ("ulysses", batch, d_model, layers, 1),
              "cp2_tp2": ("ring", batch, d_model // 2, layers, 1),
              "cp2_dp2_zero1": ("ring", batch // 2, d_model, layers, 1),
              "cp2_pp2": ("ring", batch, d_model, 1, 2),
              "cp2_pp2_ulysses_interleaved": ("ulysses", batch, d_model, 2, 2),
              "cp2_tp2_sp": ("ring", batch, d_model // 2, layers, 1),
              "cp2_pp2_zigzag": ("ring", batch, d_model, 1, 2),
              "cp2_tp2_sp_zigzag": ("ring", batch, d_model // 2, layers, 1)}
    for name, (kind, local, features, blocks, micro_batches) in shapes.items():
        want = context_bytes(kind, local, CP_SEQ, features, 2, blocks)
        for r in context_runs[name][0]:
            assert abs(r["cp_bytes"] - want) / want < 0.01 * micro_batches, \
                (name, r["rank"], r["cp_bytes"])
            assert r["cp_time_s"] >= 0


def psi_and_state(records):
    """Ψ (elements of the model) and each rank's measured params, grads, optimizer bytes."""
    return [(r["memory"]["params"], r["memory"]["grads"], r["memory"]["optimizer"])
            for r in records if r["step"] == 2]


@pytest.mark.timeout(400)
def test_zero_memory_matches_the_paper(two):
    """fp32 Adam, N = 2: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N (memory.py maps the paper's
    mixed-precision 16 bytes onto fp32).  Optimizer state also holds Adam's step counters
    (4 bytes per tensor), so compare within 1 %."""
    base = psi_and_state(two["adam_zero0"][0])[0]
    psi = base[0] / 4
    N = 2
    expected = {"adam_zero0": 16 * psi, "adam_zero1": 8 * psi + 8 * psi / N,
                "adam_zero2": 4 * psi + 12 * psi / N, "adam_zero3": 16 * psi / N}
    for name, want in expected.items():
        for params, grads, optimizer in psi_and_state(two[name][0]):
            assert abs(params + grads + optimizer - want) / want < 0.01, (name, want)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_zero_traffic_matches_the_paper(tmp_path):
    """Bytes each rank sends per step, ring collectives, N = 3: stages 0-2 move 2(N-1)/N
    of the model (all-reduce = reduce-scatter + all-gather), stage 3 3(N-1)/N (one more
    all-gather, in the backward).  Launched without TOPOLAB_CHECK, whose argument
    checks would add their own messages.  Shards are uneven here (dp = 3), so the
    share of each rank differs from (N-1)/N by a few elements: within 1 %."""
    runs = launch(tmp_path, 3, [(f"zero{s}", MLP_SGD + ["--zero", str(s), "--dp", "3"])
                                for s in (0, 1, 2, 3)], TOPOLAB_CHECK=0)
    psi = runs["zero0"][0][0]["memory"]["params"] / 4
    N = 3
    for s in (0, 1, 2, 3):
        want = (2 if s < 3 else 3) * (N - 1) / N * 4 * psi
        for r in runs[f"zero{s}"][0]:
            assert abs(r["bytes_sent"] - want) / want < 0.01, (s, r["rank"], r["bytes_sent"], want)


@pytest.mark.timeout(400)
def test_pipeline_keeps_the_schedules_activations(two):
    """Stage 0 holds all m micro-batches under GPipe, at most p = 2 under 1F1B, counted
    by the schedule and measured from the saved tensors."""
    for name, most in (("pp2_gpipe", 4), ("pp2_1f1b", 2)):
        first = [r for r in two[name][0] if r["coords"][1] == 0 and r["step"] > 0]
        assert max(r["peak_in_flight"] for r in first) == most
        for r in first:
            ratio = r["memory"]["activations_peak"] / r["micro_batch_activation_bytes"]
            assert ratio == pytest.approx(most, rel=0.15), name


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_trace_shows_the_bubbles(tmp_path):
    path = tmp_path / "trace.json"
    check_ok(mpirun(2, ["-m", "strategies.train"] + COMMON + GPT +
                    ["--pp", "2", "--micro-batches", "2", "--schedule", "gpipe",
                     "--trace", str(path)], timeout=200))
    events = json.load(open(path))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (dp 0, pp 0, tp 0)", 1: "rank 1 (dp 0, pp 1, tp 0)"}
    for pid in (0, 1):
        cats = {e["cat"] for e in events if e["ph"] == "X" and e["pid"] == pid}
        assert {"forward", "backward", "idle", "step", "optimizer"} <= cats
    # stage 1 waits for stage 0's first activation at the start of every step
    waits = [e for e in events if e["pid"] == 1 and e["name"] == "wait activation mb0"]
    assert len(waits) == 3


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_any_run_can_be_traced_even_through_parameter_servers(tmp_path):
    path = tmp_path / "ps_trace.json"
    check_ok(mpirun(3, ["-m", "strategies.train", "--steps", "3", "--threads", "1",
                        "--no-progress", "--sync", "ps", "--servers", "1"] + MLP_SGD +
                    ["--trace", str(path)], timeout=180))
    events = json.load(open(path))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "worker 0 (ps)", 1: "worker 1 (ps)"}          # the server has no steps
    for pid in (0, 1):
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        # the step's four phases, and the comm thread's push and pull of the MLP's one
        # bucket (its own track: it overlaps backward)
        assert {"forward", "backward", "comm", "optimizer", "dp-comm"} == \
            {e["cat"] for e in spans}
        assert [e["name"] for e in spans if e["cat"] == "dp-comm"] == \
            ["push/pull pp0.tp0.b0"] * 3
        assert len(spans) == 5 * 3 and all(e["dur"] >= 0 for e in spans)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bad_input_stops_every_rank_before_training(tmp_path):
    bad = {
        "dp(3) x pp(2) x tp(1) = 6 != world size 4": ["--dp", "3", "--pp", "2"],
        "--layers 2 is fewer than pp(4) stages": ["--pp", "4"],
        "--heads 2 is not divisible by tp(4)": ["--tp", "4"],
        "--zero 2 needs an all-reduce --sync": ["--zero", "2", "--sync", "ps"],
        "--micro-batches 5 is more than the 4 samples": ["--dp", "2", "--pp", "2",
                                                         "--micro-batches", "5"],
    }
    argvs = [COMMON + GPT + flags for flags in bad.values()]
    result = check_ok(mpirun(4, SEVERAL + [json.dumps(argvs)], timeout=200))
    # every rank of every run exited with 2 (mpiexec may interleave the ranks' lines)
    assert result.stdout.count("exit") == 4 * len(bad)
    assert result.stdout.replace("exit", "").replace("2", "").split() == []
    for message in bad:
        lines = [line for line in result.stderr.splitlines() if message in line]
        assert sorted(line.split(":")[0] for line in lines) == \
            [f"strategies.train rank {r}" for r in range(4)], message
    assert "loss" not in result.stdout
