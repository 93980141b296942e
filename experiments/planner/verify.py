"""Check a plan on the machine at hand: run its layouts with strategies.train, measured
beside predicted.

    cluster = this_machine(gpt, ranks=4, calibration="results")   # rate timed, links calibrated
    rows = verify(gpt, [entry, ...], cluster, steps=6)   # [(entry, steps, measured s, why)]

The machine at hand is a cluster of one node (or of the emulated cluster's
nodes, experiments/cluster) whose "GPUs" are MPI ranks on CPU cores.  Its
figures are measured, never assumed:

  compute   a transformer block (strategies/model/models.py's Block) at the model's shape
            timed forward and backward, with the threads a rank gets (the cores
            over the ranks, as strategies.train gives them), in every rank of the
            run at once, the slowest rank's (shared_cores.py): FLOPs
            (transformer.py) over seconds, efficiency 1, for each micro-batch size
            the planner may choose, since a CPU runs small matrices far below its
            best rate.  Where ranks outnumber cores, also the block split over t
            tp ranks (its t-th of the FLOPs; tp_rates), which is far from t times
            faster at small micro-batches.  The model's ends (embeddings, final
            norm, logit layer, loss) are timed the same way (measured_ends): their
            small kernels run far below the block's rate.
  links     experiments.calibrate's calibration.json (--calibration); without
            one, the cost model's example machine (5 us, 10 GB/s: costmodel.py).
            On the emulated cluster, each host's link at --inter-gbps.  Ranks on
            a GPU send device tensors by another path (CUDA IPC or staging):
            there the links are that path's, timed by the probe (shared_cores.py).
  memory    this host's memory over the ranks; its bandwidth (what the optimizer's update
            streams at, kernels.update_bytes) the calibration's np.copyto rate
            (memcpy_gbps, two ranks copying at once, one a core), a rank's share of
            it where ranks outnumber cores (memory_gbps).
  waits     where ranks outnumber cores, what a tp pair's all-reduce right after a
            block's forward waits for the peer's turn on a core (shared_cores.py),
            for each micro-batch size; and what each exchange of a tp block's
            collectives waits, in groups of every tp size (tp_waits), and an
            exchange between ranks of two such groups (cross_waits).  Where the
            search holds full recomputation, the tp block recomputed too: its
            replay's rate and its replayed exchanges' waits (torch's checkpoint
            costs small micro-batches more than the forward's FLOPs say).

Each layout runs as the sweep would run it (experiments/launchers.py: mpiexec on
this host, or the emulated cluster), with the trainer's flags (layout_args), for
enough steps to last MEASURED_S after the first two (steps_for); the measured step
is the median over the steps after the first two of the slowest rank's
step_time_s (experiments/records.py), from the trainer's JSONL.
The trainer runs the model's shape (GQA, the MLP's width, SwiGLU), the planner's own
split of the layers over the stages (--pp-layers), a mixture of experts on every split
the planner gives it, each expert's buffer of capacity factor 1 (the planner counts
each token's k copies, no padding), and the causal ring balanced over its ranks
(--cp-order zigzag), so a verified layout is the planned one; its GPT has no dropout,
and the planner plans the machine at hand's model without (experiments/plan.py).
Not offered to --verify (runnable()): what the trainer does not run (selective
recomputation, fused attention, uneven interleaved chunks, experts of another MLP
than GPT-2's, a ring it cannot balance), and experts over tp, which the trainer keeps
whole on every tp rank where the planner prices them split as the dense MLP.
"""
import contextlib
import json
import math
import os
import statistics
import subprocess
import tempfile
from dataclasses import replace

from allreduce.costs import Machine
from allreduce.records import calibration_file, checkout_pythonpath

from experiments import launchers
from experiments.records import ROOT, read_jsonl, slowest_rank, train_runs
from strategies.parallel.sequence_parallel import block_collectives

from . import shared_cores
from .cluster import GIB, Cluster
from .kernels import STREAM_SHARE
from .stages import stages_of
from .step import Layout, exchanges, group_time, tp_layer
from .transformer import layer_forward_flops

WARM_UP_STEPS = 2
# A run's timed steps last at least this long, by the prediction: this machine's speed
# drifts over tens of seconds (one layout's steps took 3.1-5.5 s in one run), and a
# layout of 0.1 s steps timed for 4 of them catches one moment of it.
MEASURED_S = 20.0
MAX_STEPS = 1000


def steps_for(predicted_s, steps, measured_s=MEASURED_S):
    """Steps of a run: at least `steps`, and enough after the warm-up to last
    `measured_s` by the prediction."""
    return min(MAX_STEPS, max(steps, WARM_UP_STEPS + math.ceil(measured_s / predicted_s)))


def this_machine(gpt, ranks, calibration=None, nodes=1, inter_gbps=1.0, sizes=(1, 2, 4, 8),
                 device="cpu", replays=False):
    """The Cluster of the machine at hand: `nodes` x `ranks` (per node) MPI ranks
    computing on `device` (cpu: its cores; cuda: its GPUs, shared by the ranks as
    strategies.train shares them), its rate timed for micro-batches of each of
    `sizes` sequences; `replays`: for layouts that recompute, the tp blocks
    recomputed too."""
    world, cores = nodes * ranks, os.cpu_count() or 1
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no GPU on this machine")
    intra, cal = Machine(5e-6, 1 / 10e9), {}
    if calibration:                   # read first: a wrong path fails before the timing
        cal = calibration_of(calibration)
        intra = Machine.from_calibration(cal)
    # each rank gets the threads strategies.train gives it; several ranks are timed
    # together, sharing the cores (or the GPU) as in the run (shared_cores.py)
    threads, waits = max(1, cores // world), None
    if world == 1:
        import torch
        torch.set_num_threads(threads)
        seconds = {b: shared_cores.block_seconds(gpt.d_model, gpt.heads, gpt.seq_len, b,
                                                 device=device, shape=shared_cores.shape_of(gpt))
                   for b in sizes}
        ends = {b: shared_cores.ends_seconds(gpt.vocab, gpt.d_model, gpt.heads, gpt.seq_len, b,
                                             device=device, shape=shared_cores.shape_of(gpt))
                for b in sizes}
    else:
        sharing = device == "cpu" and world > cores    # ranks outnumber the cores
        probed = shared_cores.measure(gpt, world, sizes, threads, device,  # tp in a node
                                      link=device == "cuda", tp_max=ranks if sharing else None,
                                      replays=replays)
        found = probed.sizes
        seconds = {b: shared.block_s for b, shared in found.items()}
        ends = {b: shared.ends_s for b, shared in found.items()}
        if probed.link:                  # ranks sharing a GPU: the device path's link
            intra = Machine(*probed.link)
        if sharing:                      # an exchange right after compute waits
            waits = tuple((b, found[b].wait_s) for b in sizes)
    # forward and backward: 3 forwards' FLOPs
    rates = tuple((b, 3 * layer_forward_flops(gpt, b) / seconds[b]) for b in sizes)
    rate = max(r for _, r in rates)
    name = "this host" if nodes == 1 else f"emulated {nodes} hosts"
    if device == "cuda":
        gpus = torch.cuda.device_count()
        memory = gpus * torch.cuda.get_device_properties(0).total_memory / world
        name += f" ({world} ranks on {gpus} {torch.cuda.get_device_name(0)})"
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world
    # on a GPU the data-parallel collectives (MPI, on the host's cores) run beside the
    # compute; on CPU cores they take the same cores, so there they add up
    cluster = Cluster(name, nodes, ranks, gpu_mem_gib=memory / GIB, gpu_tflops=rate / 1e12,
                      intra_gbps=8e-9 / intra.beta, intra_latency_us=intra.alpha * 1e6,
                      inter_gbps=inter_gbps, efficiency=1.0,
                      hbm_gbps=memory_gbps(cal, world, cores) if device == "cpu" else None,
                      calibrated_intra=intra, measured_rates=rates, core_waits=waits,
                      overlaps=device == "cuda",
                      measured_ends=tuple((b, s) for b, s in ends.items() if s is not None)
                      or None)
    if world > 1 and any(found[b].tp_blocks for b in sizes):
        blocks = [(b, block) for b, shared in found.items() for block in shared.tp_blocks]
        tp_rates = tuple((block.t, b, 3 * layer_forward_flops(gpt, b) / block.t /
                          block.local_s) for b, block in blocks)
        # a replay's own rate: its forward's FLOPs over what recomputing added locally
        # (where the noise left nothing added, none: the block's rate stands in)
        replay_rates = tuple((block.t, b, layer_forward_flops(gpt, b) / block.t /
                              (block.local_replayed_s - block.local_s))
                             for b, block in blocks if block.local_replayed_s is not None
                             and block.local_replayed_s > block.local_s)
        waits, replay_waits = tp_waits(gpt, cluster, found)
        cluster = replace(cluster, tp_rates=tp_rates, tp_waits=waits,
                          tp_replay_rates=replay_rates or None,
                          tp_replay_waits=replay_waits or None,
                          cross_waits=cross_waits(gpt, cluster, found, world) or None)
    return cluster


def memory_gbps(cal, world, cores):
    """A rank's memory bandwidth as Cluster.hbm_gbps (a datasheet's peak, of which a stream
    reaches kernels.STREAM_SHARE), from the calibration's np.copyto rate: a copy of n
    bytes moves 2 n (read, written), timed in two ranks at once, one a core; where ranks
    outnumber the cores, each core's rate is shared by its ranks, as their compute is.
    None where the calibration has no rate (the cluster's default ratio stands)."""
    copied = cal.get("memcpy_gbps")
    if not (isinstance(copied, (int, float)) and math.isfinite(copied) and copied > 0):
        return None
    return 2 * copied * min(1.0, cores / world) / STREAM_SHARE


# calibration.json's fields the planner reads (experiments/calibrate.py writes them),
# each with its least and its largest value: the link's latency, its seconds a byte
# (the planner takes its rate, 8 / beta bit/s, within cluster.FIGURE_RANGE's Gbit/s)
# and the reduction's; then curves of (bytes, value) pairs, each two arrays
SCALARS = {"alpha_s": (0.0, 1.0), "beta_s_per_byte": (8e-18, 8e-3),
           "gamma_s_per_byte": (0.0, 1.0)}
CURVES = (("beta_bytes", "beta_s_per_byte_at"), ("beta_one_way_bytes",
                                                  "beta_one_way_s_per_byte_at"),
          ("gamma_bytes", "gamma_s_per_byte_at"), ("ps_bytes", "ps_s"),
          ("ps_bytes", "ps_marginal_s"))


def calibration_of(path):
    """The calibration at `path` (a file, or a directory holding calibration.json), each
    field the planner reads checked; ValueError naming the file and the key otherwise."""
    file = calibration_file(path)
    try:
        with open(file) as f:
            cal = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--calibration {file}: not a JSON file ({e})") from None

    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value)
    if not isinstance(cal, dict):
        raise ValueError(f"--calibration {file}: holds a JSON {type(cal).__name__}, not an "
                         f"object of experiments.calibrate's fields")
    for key, (least, most) in SCALARS.items():
        value = cal.get(key)
        if not number(value) or not least <= value <= most:
            raise ValueError(f"--calibration {file}: key {key!r} must be a number from "
                             f"{least:g} to {most:g}, got {value!r}")
    if "cores" in cal and cal["cores"] is not None and (
            not isinstance(cal["cores"], int) or isinstance(cal["cores"], bool) or
            cal["cores"] < 1):
        raise ValueError(f"--calibration {file}: key 'cores' must be a whole number >= 1, "
                         f"got {cal['cores']!r}")
    for sizes, values in CURVES:
        if not cal.get(values):
            continue
        for key in (sizes, values):
            if not isinstance(cal.get(key), list) or \
                    not all(number(v) and v >= 0 for v in cal[key]):
                raise ValueError(f"--calibration {file}: key {key!r} must be a list of "
                                 f"finite numbers >= 0, got {cal.get(key)!r:.60}")
        if len(cal[sizes]) != len(cal[values]):
            raise ValueError(f"--calibration {file}: key {values!r} has {len(cal[values])} "
                             f"values for {len(cal[sizes])} {sizes!r}")
    return cal


def tp_waits(gpt, cluster, found):
    """(waits, replay waits), each ((t, b, s), ...): what an exchange of a tp collective
    waits, from the probe's tp blocks (shared_cores.SizeProbe).  A block's time over
    the ring less its time over LocalOnly, less what its collectives take on the link
    (step.tp_layer, with no wait), over their exchanges; for a replay (the blocks
    recomputed, where probed), what recomputing added over the ring less what it added
    locally, less the forward collectives' link, over their exchanges."""
    no_waits = replace(cluster, core_waits=None, tp_waits=None, tp_replay_waits=None)
    forward, backward = block_collectives(True)         # the probe's block
    waits, replay_waits = [], []
    for b, shared in found.items():
        for block in shared.tp_blocks:
            t = block.t
            link_f, link_b = tp_layer(gpt, Layout(tp=t, precision="fp32"), b, 4, no_waits)
            steps_f = sum(exchanges(c, t) for c, _ in forward)
            steps = steps_f + sum(exchanges(c, t) for c, _ in backward)
            waits.append((t, b, max(0.0, (block.ring_s - block.local_s - link_f - link_b)
                                    / steps)))
            if block.ring_replayed_s is not None:
                replay = (block.ring_replayed_s - block.ring_s) - \
                    (block.local_replayed_s - block.local_s)
                replay_waits.append((t, b, max(0.0, (replay - link_f) / steps_f)))
    return tuple(waits), tuple(replay_waits)


def cross_waits(gpt, cluster, found, world):
    """((t, b, s), ...): what an exchange between ranks of different tp groups of t
    waits, from the probe's crossed tp blocks (shared_cores.crossed: two all-to-alls
    a block with the world / t ranks t apart): what they add to the block over the
    ring, less their link, over their exchanges."""
    no_waits = replace(cluster, core_waits=None, tp_waits=None, tp_replay_waits=None)
    waits = []
    for b, shared in found.items():
        for block in shared.tp_blocks:
            if block.crossed_s is None:
                continue
            t, apart = block.t, world // block.t
            n = b * gpt.seq_len // t * gpt.d_model * 4      # the block's input, fp32
            # the probe ran on this one machine: its link is the node's own, whatever
            # nodes the cluster emulates
            link = group_time("alltoall", n, apart, t, no_waits, on_one_node=True)
            waits.append((t, b, max(0.0, (block.crossed_s - block.ring_s - 2 * link)
                                    / (2 * exchanges("alltoall", apart)))))
    return tuple(waits)


def runnable(gpt, layout):
    """'' when strategies.train runs this layout as the planner priced it, else why not."""
    if gpt.flash_attention:
        return "the trainer's attention stores its scores (no fused attention)"
    if gpt.experts and (gpt.ffn_hidden, gpt.gated_mlp) != (4 * gpt.d_model, False):
        return "the trainer's experts are GPT-2's 4 x d-model GELU MLPs (no width or gating)"
    if gpt.experts and layout.tp > 1:
        return ("the trainer keeps each expert whole on every tp rank; the planner prices "
                "the experts split over tp, as the dense MLP")
    if layout.schedule == "interleaved" and (
            (layout.stages and len(set(layout.stages)) > 1) or
            any(n % layout.virtual_stages for n in stages_of(gpt, layout))):
        return "the trainer cuts interleaved chunks evenly"
    if layout.recompute == "selective":
        return "the trainer recomputes whole blocks (--recompute), not attention alone"
    if layout.cp > 1 and layout.cp_kind == "ring" and gpt.seq_len % (2 * layout.cp):
        return (f"the planner prices the causal ring balanced; the trainer balances it in "
                f"zig-zag order, which needs --seq-len a multiple of 2 cp ({2 * layout.cp})")
    return ""


def layout_args(gpt, layout, steps, device="cpu"):
    """strategies.train's flags for `layout` (python -m strategies.train --help)."""
    args = ["--model", "moe" if gpt.experts else "gpt", "--layers", gpt.layers,
            "--d-model", gpt.d_model, "--heads", gpt.heads, "--seq-len", gpt.seq_len,
            "--vocab", gpt.vocab, "--global-batch", gpt.global_batch, "--steps", steps,
            "--sync", "ring", "--precision", layout.precision, "--device", device,
            "--no-progress"]
    args += ["--kv-heads", gpt.kv_heads]
    if gpt.experts:     # capacity factor 1: each token's k copies, as the planner counts
        args += ["--experts", gpt.experts, "--top-k", gpt.top_k, "--ep", layout.ep,
                 "--capacity-factor", 1]
    else:
        args += ["--ffn-hidden", gpt.ffn_hidden] + (["--gated-mlp"] if gpt.gated_mlp else [])
    args += ["--dp", layout.dp, "--pp", layout.pp, "--tp", layout.tp,
             "--zero", layout.zero, "--micro-batches", layout.micro_batches,
             "--schedule", layout.schedule, "--virtual-stages", layout.virtual_stages]
    if layout.pp > 1 and layout.schedule != "interleaved":   # the planner's own split
        args += ["--pp-layers", ",".join(map(str, stages_of(gpt, layout)))]
    args += ["--sequence-parallel"] if layout.sequence_parallel and layout.tp > 1 else []
    if layout.cp > 1:   # the ring balanced over its ranks, as the planner prices it
        args += ["--cp", layout.cp, "--cp-kind", layout.cp_kind]
        args += ["--cp-order", "zigzag"] if layout.cp_kind == "ring" else []
    args += ["--recompute"] if layout.recompute != "none" else []
    return [str(a) for a in args]


def launch_params(cluster, emulated):
    """The sweep's description of where a point runs (experiments/launchers.py)."""
    if not emulated:
        return {"world_size": cluster.world}
    table = {"nodes": cluster.nodes, "ranks_per_node": cluster.gpus_per_node,
             "inter_gbps": cluster.inter_gbps, "inter_latency_us": 0.0}
    return launchers.launch_params({"world_size": cluster.world}, "emulated", table)


# The planner's emulated hosts: a prefix and subnet of their own, so that a sweep's
# clusters (launchers.ClusterPlace's defaults) and ours never tear down each other.
PLACE = launchers.ClusterPlace(prefix="plan-", subnet="10.77.131.0/24")


def problems(cluster, emulated):
    """What this machine lacks to run the check (the emulated cluster needs root)."""
    return launchers.needs([("strategies.train", launch_params(cluster, emulated))], PLACE)


def measure(gpt, layout, cluster, steps, emulated=False, timeout=600, device="cpu"):
    """(median step seconds, "") of one run on `device`, or (None, why it gave none)."""
    with tempfile.TemporaryDirectory() as tmp:
        raw, log = os.path.join(tmp, "train.jsonl"), os.path.join(tmp, "cluster.log")
        p = launch_params(cluster, emulated)
        argv = launchers.head("strategies.train", p, PLACE) \
            + layout_args(gpt, layout, steps, device) + ["--jsonl", raw]
        env = {**os.environ, **PLACE.env(), "PYTHONPATH": checkout_pythonpath()}
        try:
            with launchers.ClusterLock(PLACE) if emulated else contextlib.nullcontext():
                try:
                    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True,
                                          text=True, timeout=timeout)
                finally:
                    if emulated:            # no namespace left behind, even after a timeout
                        launchers.tear_down(PLACE, log)
        except subprocess.TimeoutExpired:
            return None, f"no result in {timeout} s"
        if done.returncode:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            return None, f"exit {done.returncode}: {lines[-1]}"
        runs = train_runs(read_jsonl(raw))
        times = [t for _, step_records in runs.values()
                 for step, t in sorted(slowest_rank(step_records).items())
                 if step >= WARM_UP_STEPS]
        if not times:
            return None, f"no step after the first {WARM_UP_STEPS} in the trainer's records"
        return statistics.median(times), ""


def verify(gpt, entries, cluster, steps=6, emulated=False, device="cpu",
           measured_s=MEASURED_S):
    """[(entry, steps run, measured seconds or None, why)] for each entry, one run
    after another, each of steps_for(its prediction) steps."""
    rows = []
    for e in entries:
        n = steps_for(e.prediction.step_s, steps, measured_s)
        rows.append((e, n, *measure(gpt, e.prediction.layout, cluster, n, emulated,
                                    device=device)))
    return rows
