"""Mixture of experts (strategies/model/moe.py) and expert parallelism (strategies/parallel/expert_parallel.py).

Tier (a), no processes: GShard's gating on hand-made logits (the docstring's table;
second choices queue behind every first choice), the MoE layer against a
token-by-token loop written independently of the einsums, the expert placement,
and the ConfigErrors.

Tier (c), one mpiexec launch at P = 2 against one at P = 1: expert parallelism
(--ep 2, top-2 and top-1 with tokens dropped), plain data parallelism of the MoE
model (--ep 1), and the expert-parallel engine at ep 1, where each expert has two
replicas whose gradients go through the replica all-reduce.  Each must train the
same model as `--sync local --moe-group 4` on one process: capacity is per
group of 4 sequences, one rank's local batch, so the same tokens are dropped.
Under micro-batches without --moe-group the group is one micro-batch, the
--moe-group the run's config record names and its reference is given.

Tolerance: rtol = 1e-5, atol = 1e-6, as for the other workers (test_parallel_runs.py):
only the order of float additions changes (the dp average of partial means, an
expert's gradient summed over the ranks' tokens, the experts' matmuls over a
different number of rows).  Measured differences after 3 steps are ~1e-7; a token
sent to the wrong expert or a gradient averaged over the wrong ranks moves values
by O(lr * grad) ~ 1e-3.
"""
import json
import math

import numpy as np
import pytest
import torch

from conftest import check_ok, mpirun
from strategies.config.choices import ConfigError
from strategies.config.settings import TrainConfig, with_moe_group
from strategies.config.validate import check_world
from strategies.parallel.expert_parallel import ExpertPlacement, alltoall_bytes_per_step
from strategies.config.mesh import Mesh
from strategies.model.moe import MoE, expert_capacity, route

RTOL, ATOL = 1e-5, 1e-6


# ---- tier (a): gating, the layer, placement, flags ----------------------------------

def logits_for(choices, E):
    """Logits whose softmax ranks the experts of each token as `choices` lists them."""
    logits = torch.zeros(1, len(choices), E)
    for s, ranking in enumerate(choices):
        for place, e in enumerate(ranking):
            logits[0, s, e] = 3.0 - place
    return logits


def test_route_drops_tokens_over_capacity_as_the_docstring_table():
    first = [0, 2, 0, 0, 1, 2]
    dispatch, combine, _ = route(logits_for([[e] for e in first], 3), top_k=1, capacity=2)
    kept = dispatch.sum(dim=(2, 3))[0]
    assert kept.tolist() == [1, 1, 1, 0, 1, 1]          # t3: expert 0 is full
    positions = dispatch[0].sum(dim=1).argmax(dim=-1)   # (S,): the slot of each kept token
    assert [positions[s].item() for s in (0, 1, 2, 4, 5)] == [0, 0, 1, 0, 1]
    # top-1: the output is scaled by the probability of the chosen expert
    probs = torch.softmax(logits_for([[e] for e in first], 3), -1)[0]
    assert torch.allclose(combine[0].sum(dim=(1, 2)),
                          probs[torch.arange(6), first] * kept)


def test_route_second_choices_queue_behind_every_first_choice():
    # tokens 0, 1 prefer expert 0 then 1; tokens 2, 3 prefer expert 1 then 0; C = 3
    dispatch, combine, _ = route(logits_for([[0, 1], [0, 1], [1, 0], [1, 0]], 2), 2, 3)
    d = dispatch[0]                                       # (S, E, C)
    assert d[:, 0].sum(dim=-1).tolist() == [1, 1, 1, 0]   # expert 0: t0 t1, then t2's 2nd
    assert d[:, 1].sum(dim=-1).tolist() == [1, 0, 1, 1]   # expert 1: t2 t3, then t0's 2nd
    assert d[2, 0, 2] == 1 and d[0, 1, 2] == 1            # second choices at position 2
    # GShard's gates: the two chosen probabilities normalised to sum to one
    assert torch.allclose(combine[0, 0].sum(), torch.tensor(1.0))
    assert combine[0, 1].sum() < 1                        # t1 lost its second expert


def test_capacity_formula():
    assert expert_capacity(32, 4, 2, 1.25) == 20          # ceil(1.25 * 2 * 32 / 4)
    assert expert_capacity(32, 4, 1, 0.5) == 4
    assert expert_capacity(4, 2, 2, 10.0) == 4            # never more than the group


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_layer_equals_a_token_by_token_loop(top_k):
    torch.manual_seed(0)
    E, d, group = 4, 8, 2
    moe = MoE(d, E, top_k, capacity_factor=0.6, group_size=group, balance_coef=0.0)
    x = torch.randn(4, 3, d)
    with torch.no_grad():
        y = moe(x)
        expected = torch.zeros_like(x)
        tokens = x.reshape(-1, group * 3, d)              # the groups, tokens in order
        C = expert_capacity(group * 3, E, top_k, 0.6)
        out = expected.view(-1, group * 3, d)
        dropped = 0
        for g, xs in enumerate(tokens):
            probs = torch.softmax(moe.gate(xs), -1)
            ranked = probs.argsort(dim=-1, descending=True)[:, :top_k]
            chosen = probs.gather(1, ranked)
            gates = chosen if top_k == 1 else chosen / chosen.sum(-1, keepdim=True)
            load = [0] * E
            for k in range(top_k):                        # every first choice first
                for s in range(len(xs)):
                    e = ranked[s, k].item()
                    if load[e] == C:
                        dropped += 1
                        continue
                    load[e] += 1
                    out[g, s] += gates[s, k] * moe.experts[str(e)](xs[s])
    assert dropped > 0                                    # the capacity did bite
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


def test_expert_placement():
    placed = [ExpertPlacement(Mesh(4, ep=2), 8, r) for r in range(4)]
    assert [list(p.local_experts) for p in placed] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert [(p.group, p.ep_rank) for p in placed] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert placed[0].replicas == 2


MOE = dict(model="moe", sync="ring", experts=4)


@pytest.mark.parametrize("flags, world, message", [
    (dict(MOE, ep=3), 3, "--experts 4 is not divisible by ep(3)"),
    (dict(MOE, ep=2, sync="local"), 1, "needs an all-reduce --sync"),
    (dict(MOE, ep=2, sync="hybrid", ranks_per_node=3, global_batch=12), 7,
     "--ranks-per-node 3 with --ep 2 under --sync hybrid puts 1 or 2 replicas"),
    (dict(MOE, ep=2, model="gpt"), 2, "not of --model gpt"),
    (dict(MOE, pp=2, micro_batches=3, global_batch=8), 2,
     "--micro-batches 3 cuts each replica's 8 sequences (global batch 8 / dp(1)) into "
     "micro-batches of 3 and 2"),
    (dict(MOE, top_k=3), 2, "--top-k 3 must be 1 or 2"),
    (dict(MOE, capacity_factor=0.0), 2, "--capacity-factor must be > 0"),
    (dict(MOE, ep=2, global_batch=6), 3, "world 3 is not a multiple of ep(2)"),
    (dict(MOE, moe_group=3, global_batch=8), 2, "--moe-group 3 does not divide"),
])
def test_config_errors(flags, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_world(TrainConfig(**flags), world)


@pytest.mark.parametrize("flags, world, group", [
    (dict(MOE, global_batch=8), 2, 4),                       # the local batch, as before
    (dict(MOE, pp=2, micro_batches=2, global_batch=8), 2, 4),            # dp 1: 8 / 2
    (dict(MOE, pp=2, micro_batches=2, schedule="interleaved", virtual_stages=2, layers=4,
          global_batch=8), 2, 4),
    (dict(MOE, grad_accum=2, global_batch=8), 2, 2),                     # dp 2: 4 / 2
    (dict(MOE, sync="ps", servers=1, grad_accum=2, global_batch=12), 4, 2),  # dp 3: 4 / 2
    (dict(MOE, grad_accum=2, moe_group=1, global_batch=8), 2, 1),        # given: kept
    (dict(model="gpt", sync="ring", grad_accum=2), 2, 0),                # no experts
])
def test_the_default_gating_group_is_one_forward_calls(flags, world, group):
    """--moe-group 0 is written into the run's config as the sequences of one forward
    call of a replica, one of its micro-batches, a group the world then accepts; the
    all-to-all formula reads the same group from either config."""
    cfg = TrainConfig(**flags)
    dp = check_world(cfg, world)
    resolved = with_moe_group(cfg, dp)
    assert resolved.moe_group == group
    assert check_world(resolved, world) == dp
    if group:
        assert alltoall_bytes_per_step(resolved, dp) == alltoall_bytes_per_step(cfg, dp)


SMALL_MOE = dict(MOE, layers=2, d_model=16, heads=2, seq_len=8, global_batch=8, top_k=2,
                 capacity_factor=1.0)


@pytest.mark.parametrize("flags, world, sent", [
    # dp 2: a group of 4 sequences, 32 tokens, C = ceil(2 * 32 / 4) = 16; the buffer
    # 4 experts x 16 x d 16 x 4 bytes = 4096, half of it leaves: 2048 a call, 8 calls
    (dict(SMALL_MOE, ep=2), 2, 16384),
    (dict(SMALL_MOE, sync="ps", servers=1, ep=2, dp=2), 3, 16384),    # the server gates none
    (dict(SMALL_MOE, ep=2, dp=2, tp=2), 4, 16384),                     # tp: the same tokens
    # pp 2: one block a stage; 2 micro-batches of 2 sequences, 16 tokens, C = 8: 1024 a call
    (dict(SMALL_MOE, ep=2, dp=2, pp=2, micro_batches=2), 4, 4 * 1 * 2 * 1024),
    # cp 2 (dp 1): the replica's 8 sequences, 4 positions each on a rank: 32 tokens, C = 16
    (dict(SMALL_MOE, ep=2, cp=2), 2, 16384),
])
def test_the_alltoall_formula_reads_the_split_not_the_world(flags, world, sent):
    """A rank's all-to-all bytes a step count the blocks of its stage, the sequences of its
    replica (global batch / dp, not / world) and the positions it gates (seq_len / cp),
    each worked out by hand above (alltoall.py: a pairwise exchange at ep 2)."""
    cfg = TrainConfig(**flags)
    dp = check_world(cfg, world)
    assert alltoall_bytes_per_step(with_moe_group(cfg, dp), dp) == sent


def test_a_pipeline_cuts_the_moe_by_its_layers():
    assert TrainConfig(**dict(MOE, layers=4, depth=2)).blocks == (4, "--layers")
    assert TrainConfig(**dict(MOE, pp=2, layers=4, pp_layers="1,3")).pp_layers == "1,3"


def test_capacity_figure_reads_the_records(tmp_path):
    """The figure's formula beside its measured bytes, from config records of a ring run
    and of a run over a parameter server (world 3 = dp 2 + a server: the formula
    reads dp_size, not the world); the bytes are test_the_alltoall_formula's by hand."""
    from experiments.moe_plots import capacity_runs, moe_capacity
    records = []
    for run, (top_k, factor, dropped, sync, world) in enumerate([
            (1, 0.5, 0.5, "ring", 2), (1, 1.0, 0.1, "ring", 2), (2, 1.0, 0.0, "ps", 3)]):
        config = TrainConfig(**dict(SMALL_MOE, sync=sync, ep=2, dp=2, top_k=top_k,
                                    capacity_factor=factor)).as_dict()
        records.append({"kind": "config", "run_id": run, **config, "world_size": world,
                        "dp_size": 2})
        # C = ceil(factor * k * 32 / 4) of 32 tokens: 4, 8, 16; 8 calls of half of 4 C 16 4
        sent = 8 * 4 * math.ceil(factor * top_k * 8) * 16 * 4 // 2
        records += [{"kind": "step", "run_id": run, "step": step, "rank": rank,
                     "alltoall_bytes": sent, "dropped_fraction": dropped}
                    for step in range(3) for rank in range(2)]
    runs = capacity_runs(records)
    assert [p[:2] for p in runs[1]] == [(0.5, 0.5), (1.0, 0.1)]
    assert [p[2:] for p in runs[2]] == [(16384, 16384)]
    assert all(measured == formula for p in runs[1] + runs[2] for measured, formula in [p[2:]])
    assert moe_capacity(records, tmp_path).endswith("moe_capacity.png")


# ---- tier (c): P = 2 against one process ---------------------------------------------

COMMON = ["--steps", "3", "--threads", "1", "--no-progress", "--model", "moe", "--experts", "4",
          "--layers", "2", "--d-model", "16", "--heads", "2", "--vocab", "12", "--seq-len", "8",
          "--dataset-size", "120", "--global-batch", "8", "--lr", "0.05", "--momentum", "0.9"]
TOP2 = ["--top-k", "2", "--capacity-factor", "1.0"]
TOP1 = ["--top-k", "1", "--capacity-factor", "0.5"]       # 4 of 32 tokens per expert
# One launch trains every run in turn (torch's import costs more than these runs).
# "--replicas" runs the expert-parallel engine at ep 1: all experts on each rank,
# two replicas of each, their gradients through the replica all-reduce.
SCRIPT = ["-c", "import json, sys\nimport strategies.train as train\n"
                "import strategies.engine.parallelize as par\n"
                "plain = par.experts_apart\n"
                "for argv in json.loads(sys.argv[1]):\n"
                "    par.experts_apart = (lambda cfg: True) if '--replicas' in argv else plain\n"
                "    train.main([a for a in argv if a != '--replicas'])\n"]


def launch(tmp_path, nprocs, runs):
    argvs = [COMMON + flags + ["--jsonl", str(tmp_path / f"{name}.jsonl"),
                               "--params-out", str(tmp_path / f"{name}.npz")]
             for name, flags in runs]
    check_ok(mpirun(nprocs, SCRIPT + [json.dumps(argvs)], timeout=300))
    out = {}
    for name, _ in runs:
        records = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
        out[name] = ([r for r in records if r["kind"] == "step"],
                     dict(np.load(tmp_path / f"{name}.npz")),
                     next(r for r in records if r["kind"] == "config"))
    return out


LOCAL = ["--sync", "local", "--moe-group", "4"]
EP2 = ["--sync", "ring", "--ep", "2"]


def assert_reproduce(runs, reference, ranks=2):
    """Each run's losses (on each of its `ranks`) and parameters equal the one-process
    run named by its suffix (top1, top2)."""
    for name, (records, params, _) in runs.items():
        ref_records, ref_params, _ = reference[name.split("_")[-1]]
        ref_loss = [r["loss"] for r in ref_records]
        for rank in range(ranks):
            mine = [r for r in records if r["rank"] == rank]
            np.testing.assert_allclose([r["loss"] for r in mine], ref_loss, rtol=RTOL,
                                       atol=ATOL, err_msg=name)
        assert sorted(params) == sorted(ref_params), name
        for key in ref_params:
            np.testing.assert_allclose(params[key], ref_params[key], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name}: {key}")


def assert_counted_as_the_formula(runs, names):
    """Each rank's `alltoall_bytes` a step is alltoall_bytes_per_step's for its run's
    config record (dp_size, the stages' blocks, the cp slice), plus the few bytes a call
    of the TOPOLAB_CHECK exchange that conftest switches on (at most 128: the slow
    test's bound)."""
    for name in names:
        records, _, config = runs[name]
        payload = alltoall_bytes_per_step(config, config["dp_size"])
        calls = 4 * config["layers"] // config["pp"] * config["micro_batches"]
        assert payload > 0, name
        for r in records:
            assert 0 <= r["alltoall_bytes"] - payload <= calls * 128, \
                (name, r["rank"], r["alltoall_bytes"], payload)


@pytest.mark.timeout(300)
def test_expert_parallel_over_torch_distributed_reproduces_one_process(tmp_path):
    """The experts' all-to-alls over torch.distributed's (gloo) all_to_all_single, the
    dense layers' all-reduces over its all_reduce, on the main thread (--no-overlap) or
    on the comm thread, each communicator on a torch group of its own."""
    reference = launch(tmp_path, 1, [("top2", TOP2 + LOCAL)])
    assert_reproduce(launch(tmp_path, 2, [
        ("ep2torch_top2", TOP2 + ["--sync", "torch", "--ep", "2"]),
        ("ep2torchhook_top2", TOP2 + ["--sync", "torch", "--ep", "2", "--no-overlap"])]),
        reference)


@pytest.mark.timeout(400)
def test_the_mixture_of_experts_under_every_split_reproduces_one_process(tmp_path):
    """The MoE on a pipeline (each stage carries its blocks' balance loss, the last adds
    the stages' values into the step's loss: parallel/pipeline.py), under ZeRO-3 with
    its experts (each gathered over its replicas by its own forward's hook, beside the
    all-to-alls on the expert group), under gradient accumulation and recompute.  The
    gating groups are fixed by --moe-group, so micro-batches route as the batch does;
    without it the group is one micro-batch of a replica (config/validate.py's
    gating_group), written into the run's config: 8 / 2 on the pipelines (dp 1), 4 / 2
    under accumulation (dp 2), each reproducing one process at that --moe-group."""
    reference = launch(tmp_path, 1, [("top2", TOP2 + LOCAL),
                                     ("top2g2", TOP2 + ["--sync", "local", "--moe-group", "2"]),
                                     ("top2l4", TOP2 + LOCAL + ["--layers", "4"])])
    pp2 = ["--sync", "ring", "--pp", "2", "--micro-batches", "2"]
    runs = launch(tmp_path, 2, [
        ("pp2_top2", TOP2 + pp2 + ["--moe-group", "4"]),
        ("ep2zero3_top2", TOP2 + EP2 + ["--zero", "3"]),
        ("accum_top2g2", TOP2 + ["--sync", "ring", "--moe-group", "2", "--grad-accum", "2"]),
        ("ep2recompute_top2", TOP2 + EP2 + ["--recompute"]),
        ("pp2default_top2", TOP2 + pp2),
        ("interleaveddefault_top2l4", TOP2 + pp2 + ["--schedule", "interleaved",
                                                    "--virtual-stages", "2", "--layers", "4"]),
        ("accumdefault_top2g2", TOP2 + ["--sync", "ring", "--grad-accum", "2"])])
    assert_reproduce(runs, reference)
    for name, group in (("pp2default_top2", 4), ("interleaveddefault_top2l4", 4),
                        ("accumdefault_top2g2", 2)):
        assert runs[name][2]["moe_group"] == group, name


@pytest.mark.timeout(400)
def test_the_mixture_of_experts_on_the_grid_reproduces_one_process(tmp_path):
    """Four ranks.  Tensor parallelism: attention split over tp as the GPT's, the experts
    replicated over the tp ranks (parallel/tensor_parallel.py), with and without
    sequence parallelism (the MoE between an all-gather and a cut of the positions),
    and with the experts over --ep 2 at each tp place.  A pipeline: each stage's
    experts over --ep 2 of its stage's replicas, and ZeRO-1 over a stage's layers.
    Each replica's local batch is 4 sequences: --moe-group 4 (one gating group), or
    2 where two micro-batches each hold a group."""
    reference = launch(tmp_path, 1, [("top2", TOP2 + LOCAL),
                                     ("top2g2", TOP2 + ["--sync", "local", "--moe-group", "2"])])
    grid = ["--sync", "ring", "--dp", "2"]
    runs = launch(tmp_path, 4, [
        ("tp2_top2", TOP2 + grid + ["--tp", "2"]),
        ("tp2sp_top2", TOP2 + grid + ["--tp", "2", "--sequence-parallel"]),
        ("tp2ep2_top2", TOP2 + grid + ["--tp", "2", "--ep", "2"]),
        ("pp2ep2_top2g2", TOP2 + grid + ["--pp", "2", "--ep", "2", "--moe-group", "2",
                                         "--micro-batches", "2"]),
        ("pp2zero1_top2", TOP2 + grid + ["--pp", "2", "--zero", "1", "--moe-group", "4"])])
    assert_reproduce(runs, reference, ranks=4)
    # the tokens crossed the expert groups, as many bytes as the formula says
    assert_counted_as_the_formula(runs, ("tp2ep2_top2", "pp2ep2_top2g2"))


@pytest.mark.timeout(400)
def test_expert_parallel_over_the_parameter_servers_reproduces_one_process(tmp_path):
    """--sync ps, 4 workers and a server: an expert's buckets are pushed under keys that
    name its place in the expert group (pp0.tp0.ep1.b3), whose group on the servers is
    the expert's replicas, two of them at --dp 4 --ep 2 and one at --dp 2 --tp 2 --ep 2,
    the dense buckets under the keys of the dp axis; the tokens cross on the ring.
    --sync hybrid (in the same launch): an expert's node is its replicas on the node,
    which ring-average its buckets before their leader's push.  On one host the dense
    node is all four ranks, led by rank 0, and the experts' nodes are {0, 2} and {1, 3},
    so rank 1 leads expert keys and no dense key; with --ranks-per-node 2 the dense
    nodes are {0, 1} and {2, 3} and each expert node is one rank, which pushes alone."""
    reference = launch(tmp_path, 1, [("top2", TOP2 + LOCAL),
                                     ("top2g2", TOP2 + ["--sync", "local", "--moe-group", "2"])])
    ps = ["--sync", "ps", "--servers", "1", "--ep", "2"]
    hybrid = ["--sync", "hybrid", "--servers", "1", "--ep", "2", "--dp", "4"]
    runs = launch(tmp_path, 5, [("psdp4_top2g2", TOP2 + ps + ["--dp", "4"]),
                                ("pstp2_top2", TOP2 + ps + ["--dp", "2", "--tp", "2"]),
                                ("hybriddp4_top2g2", TOP2 + hybrid),
                                ("hybridrpn2_top2g2", TOP2 + hybrid + ["--ranks-per-node", "2"])])
    assert_reproduce(runs, reference, ranks=4)
    assert_counted_as_the_formula(runs, runs)       # world 5: dp 4, or dp 2 x tp 2


@pytest.mark.timeout(400)
def test_expert_parallel_with_lossy_compression_trains_as_float32(tmp_path):
    """Four ranks, --ep 2: each expert's two replicas reduce its buckets through the same
    compressor as the dense layers' (top-k and fp8 all-gather over the expert's
    replicas, PowerSGD all-reduces its factors there), with error feedback per bucket.
    Lossy, so not equal to float32: the final loss (step 8) within 10 % of the float32
    run's, the compression tests' criterion (test_compress.py).  top-k keeping every
    entry (topk:1) is exact, so it reproduces one process as float32 does: an expert's
    buckets gathered over the wrong ranks would add other experts' gradients."""
    reference = launch(tmp_path, 1, [("top2g2", TOP2 + ["--sync", "local", "--moe-group", "2"])])
    ep = ["--sync", "ring", "--ep", "2"]
    runs = launch(tmp_path, 4, [("topk1_top2g2", TOP2 + ep + ["--compress", "topk:1"])] +
                  [(kind.replace(":", ""), TOP2 + ep + ["--steps", "8", "--compress", kind])
                   for kind in ("none", "topk:0.3", "powersgd:2", "fp8")])
    assert_reproduce({"topk1_top2g2": runs.pop("topk1_top2g2")}, reference, ranks=4)
    final = {name: records[-1]["loss"] for name, (records, _, _) in runs.items()}
    first = runs["none"][0][0]["loss"]
    assert final["none"] < first                          # float32 trains
    for name in ("topk0.3", "powersgd2", "fp8"):
        assert abs(final[name] - final["none"]) <= 0.1 * final["none"], (name, final)


@pytest.mark.timeout(300)
def test_expert_parallel_under_zero1_reproduces_one_process(tmp_path):
    """ep carved out of dp: ZeRO-1 shards the dense layers over the world and each
    expert over its replicas (one rank each at ep 2).  In the quick tier: the one
    worker's expert split composed with its data parallelism."""
    reference = launch(tmp_path, 1, [("top2", TOP2 + LOCAL)])
    assert_reproduce(launch(tmp_path, 2, [("ep2zero1_top2", TOP2 + EP2 + ["--zero", "1"])]),
                     reference)


@pytest.mark.timeout(400)
def test_the_experts_over_context_groups_match_the_same_cp_run(tmp_path):
    """--cp 2: the experts' replicas are the dp x cp replicas (config/mesh.py), under
    ZeRO-1 and ZeRO-3 (each expert sharded over both cp ranks) and --ep 2 (the expert
    group is the context group: each rank's positions' tokens go to the other's
    experts).  A MoE at cp > 1 gates each rank's own positions (parallel/
    context_parallel.py), so it is not one process's; the reference is the same cp run
    with the model whole on each rank.  Tolerance rtol 1e-4, atol 1e-6 (CP_RTOL of
    test_parallel_runs.py); measured: ZeRO equal bit for bit, --ep 2 within 2.5e-6
    relative (its experts' matmuls run on the group's rows at once); an expert averaged
    over dp alone (one rank here) would differ by O(lr * grad) ~ 1e-3."""
    cp = TOP2 + ["--sync", "ring", "--cp", "2"]
    runs = launch(tmp_path, 2, [("cp2", cp), ("cp2zero1", cp + ["--zero", "1"]),
                                ("cp2zero3", cp + ["--zero", "3"]), ("cp2ep2", cp + ["--ep", "2"])])
    def losses(records):
        return [r["loss"] for r in sorted(records, key=lambda r: (r["step"], r["rank"]))]
    records, params, _ = runs["cp2"]
    assert len(records) == 2 * 3
    for name in ("cp2zero1", "cp2zero3", "cp2ep2"):
        np.testing.assert_allclose(losses(runs[name][0]), losses(records), rtol=1e-4,
                                   err_msg=name)
        assert sorted(runs[name][1]) == sorted(params), name
        for key, value in params.items():
            np.testing.assert_allclose(runs[name][1][key], value, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name}: {key}")
    assert_counted_as_the_formula(runs, ("cp2ep2",))    # each rank gates its 4 positions


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_expert_parallel_reproduces_one_process(tmp_path):
    reference = launch(tmp_path, 1, [("top2", TOP2 + LOCAL), ("top1", TOP1 + LOCAL)])
    runs = launch(tmp_path, 2, [
        ("ep2_top2", TOP2 + EP2), ("ep2_top1", TOP1 + EP2),
        ("dp2_top2", TOP2 + ["--sync", "ring"]),
        ("replicas_top2", TOP2 + ["--sync", "tree", "--replicas"]),
        ("zero2_top1", TOP1 + ["--sync", "ring", "--zero", "2", "--no-overlap"])])
    assert_reproduce(runs, reference)
    # the records count the all-to-alls as the formula does (expert_parallel.py), plus
    # the few bytes per call of the TOPOLAB_CHECK exchange that conftest switches on
    for name, capacity in (("ep2_top2", 16), ("ep2_top1", 4)):    # C of 32 tokens
        records, _, config = runs[name]
        payload = alltoall_bytes_per_step(config, 2)
        # 2 blocks x 4 calls x half of the (E = 4, G = 1, C, d = 16) float32 buffer
        assert payload == 2 * 4 * (4 * capacity * 16 * 4) // 2
        for r in records:
            assert 0 <= r["alltoall_bytes"] - payload <= 8 * 128, (name, r["alltoall_bytes"])
            assert r["alltoall_time_s"] > 0 and 0 <= r["dropped_fraction"] < 1
    assert all(r["alltoall_bytes"] == 0 for r in runs["replicas_top2"][0])
