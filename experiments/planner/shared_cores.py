"""What sharing this host's cores costs a rank: its compute rate among the other
ranks, and an exchange's wait for its peer's turn on a core.

    mpiexec -n 4 python -m mpi4py -m experiments.planner.shared_cores --d-model 128 \
        --heads 4 --seq-len 64 --batches 1,8 --threads 1   # {"sizes": {"1": {"block_s": ...
    found = shared_cores.measure(gpt, ranks=4, batches=(1, 8), threads=1)  # from Python
    found.sizes[8].block_s, found.sizes[8].wait_s

On the machine at hand the planner's "GPUs" are MPI ranks on CPU cores, or ranks
sharing its GPUs (verify.py).  A cluster gives every rank a device of its own; here
the ranks share the cores, the caches and the memory bandwidth (or the GPU), and
the probe measures what that costs with every rank of the run there at once:

1. The rate.  Every rank times a transformer block's forward and backward at the
   model's shape (strategies/model/models.py's Block), all ranks together, with
   the threads the trainer gives each.  A synchronous step goes at the pace of its
   slowest rank, so the probe reports the slowest rank's mean over half a second
   of blocks at least (SHARED_S: many time slices, where a few blocks would each
   fall on one side of a slice or the other).  Every figure below is taken in
   ROUNDS rounds, each round through every micro-batch size, so that each size's
   figures span the whole probe: this machine's speed drifts over tens of seconds,
   and a size timed in one stretch caught one speed.  Timed alone in
   one process and scaled by the ranks' share of the cores instead, a block of
   the 4-layer GPT in docs/measurements/planner/README.md took 4.9 ms x 2 = 9.8 ms, where 4 ranks on
   2 cores took 9.7-12.2 ms each: the slowest 1.24 times the scaled figure.
2. The wait, where ranks outnumber cores.  A rank that reaches a blocking
   exchange right after computing finds its peer descheduled, running someone
   else's compute, and waits for the scheduler to give the peer its next turn:
   about a time slice, milliseconds, where the link itself takes microseconds.
   Megatron's tensor parallelism puts two all-reduces in every layer's forward
   and two in its backward, each right after the compute that feeds it, so on
   such a machine each one pays that wait.  The ranks go in pairs (a tp group of
   2; an odd last rank computes alone); every one runs a block's forward and then
   all-reduces b s h values with its partner, through the ring the trainer uses,
   and again with no compute in between, when every rank is polling and nobody
   waits.  The wait is the mean all-reduce after compute less the mean
   without, on the slowest rank.  A tp group of t ranks makes 2 (t - 1)
   exchanges an all-reduce, t - 1 times the pair's (step.py).
3. The link, where the ranks share a GPU (`--link`).  Their tensors go from rank to
   rank the way the trainer sends them (strategies/sync/gradient_sync.for_device:
   CUDA IPC between ranks on one GPU, allreduce/cuda_ipc.py; staged through host
   memory otherwise), not as experiments.calibrate's host buffers go, and that path
   has a latency of its own: on one H100 a 4 KiB ring all-reduce of two ranks took
   1.3 ms over IPC where the host calibration's alpha was microseconds.  Pairs time
   the trainer's ring on the device at a small and a large size (LINK_SIZES) and
   fit t(n) = 2 alpha + n beta, the ring's time at P = 2 with the reduction free
   (costmodel.py), on the slowest pair.
4. A tensor-parallel block, where ranks outnumber cores (`--tp-max`).  A block
   split over t ranks is far from t times faster at small micro-batches (its
   matrices are t times smaller), and its collectives, 66 exchanges a block at
   t = 4 with sequence parallelism, wait for turns on the cores as the pair's
   all-reduce does, but after less compute each.  So the probe times the block
   itself in groups of every t, over the trainer's ring and over LocalOnly (the
   same block, its collectives moving nothing): the second is the block's own
   rate, the difference its communication (verify.tp_waits takes the link off,
   per exchange).  At 4 ranks on 2 cores here, b = 1: 3.0 ms local against 14.7
   ms over the ring, where the whole block alone took 3.8 ms.  The kinds take
   turns in SLICES slices a round, and each difference is taken within a slice
   and averaged over the middle half of the slices (SizeProbe.tp_result): the
   machine's other work lands on one kind or another, and a wait is a small
   difference of two large times.
5. The same tp block recomputed (`--replays`: the trainer's --recompute, the block
   checkpointed as strategies/parallel/recompute.py checkpoints it), over the ring
   and over LocalOnly.  A replay is one more forward, a third of the block's
   FLOPs, but torch's checkpoint adds work of its own that small micro-batches
   feel: at 4 ranks on 2 cores, b = 1, the local block took 2.4-3.1 ms more
   recomputed, where a third of its 3.0 ms was expected; its collectives'
   replays waited about as much as the block's own (0.23-0.28 against 0.20-0.22
   ms an exchange).
6. The tp block coupled to another tp group (`--tp-max`, where the ranks make two
   groups of t at least).  Ulysses' all-to-alls pair a rank with the ranks of its
   context group, pp tp apart, and ZeRO-3 gathers each layer over the replicas,
   as far apart: ranks of different tp groups.  Each group's collectives keep its
   own ranks in step, but not with the other group's, so an exchange across
   groups finds its partner in the middle of its own group's block, and at 4
   ranks on 2 cores, descheduled: it waits about a time slice where a tp
   exchange waits a third of one.  So the ring's tp block is also timed with an
   all-to-all with the rank t apart at the start of its forward and at the end of
   its backward (where ZeRO-3 gathers a layer), each of b s / t h values; what
   that adds to the block over the ring, less the link, is the wait of an
   exchange across groups (verify.cross_waits).  At 4 ranks on 2 cores, tp2 cp2
   Ulysses ZeRO-3 b1 measured 2.50-2.67 s a step where the whole prediction
   without these waits was 1.84 s: 0.37-0.41 s in the all-to-alls (0.43-0.57 ms
   each), 0.27-0.29 s in the ZeRO-3 gathers (0.68-0.81 ms each), and compute
   0.8-0.9 s where the probe's block said 0.4 (docs/measurements/planner/README.md).
7. The model's ends (`--vocab`): the token and position embeddings, the final norm,
   the logit layer and the loss (strategies/model/models.py's GPT with no block),
   forward and backward, among all ranks as the block is.  Their FLOPs are a few
   per cent of the blocks', but on a CPU their small kernels run far below the
   blocks' rate: one thread here took 1.09-1.19 times its 4 blocks' time for the
   whole 4-layer GPT of d_model 128 and vocabulary 256, where the logit layer's
   FLOPs at the blocks' rate make 1.04.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

from allreduce.harness import interquartile_mean
from allreduce.records import checkout_pythonpath

from experiments.records import mpiexec_path

ROUNDS = 3          # every figure in this many rounds, each round through every size
SLICES = 4          # a round's tp blocks in this many slices, each through every kind
CALLS = 120         # a pair's all-reduces of each kind, over the rounds
WARM_UP = 8         # ... after this many that warm the ring up
BLOCK_REPEATS = 15  # a block's forward and backward, after one that warms up
SHARED_S = 0.5      # ... and at least this long, where ranks share the cores
MAX_REPEATS = 2000
LINK_SIZES = ((4 << 10, 120), (16 << 20, 20))     # (bytes, all-reduces) the link is fitted to


class Shared(NamedTuple):
    """What the probe found at one micro-batch size."""
    block_s: float      # the slowest rank's forward and backward of one block
    wait_s: float       # a pair all-reduce's wait after compute (0: a core for every rank)
    tp_blocks: tuple = ()   # (TpBlock, ...): a tp block in groups of t (SizeProbe)
    ends_s: float = None    # the model's ends forward and backward (--vocab), slowest rank


class TpBlock(NamedTuple):
    """A sequence-parallel block's forward and backward in groups of t ranks."""
    t: int
    ring_s: float                   # over the trainer's ring
    local_s: float                  # over LocalOnly: its compute alone
    ring_replayed_s: float = None   # recomputed (--replays), over the ring
    local_replayed_s: float = None  # ... and over LocalOnly
    # over the ring with an all-to-all with the rank t apart, in another tp group, at
    # the start of its forward and at the end of its backward (crossed)
    crossed_s: float = None


class Probed(NamedTuple):
    sizes: dict         # micro-batch size -> Shared
    link: tuple = None  # (alpha s, beta s a byte) of the device path (--link), or None


def shape_of(gpt):
    """The Block keywords of the planner's GPT beside d_model and heads: its key-value
    heads, its MLP's width and gating (strategies/model/models.py), so that the probe
    times the block the trainer will run."""
    return {"kv_heads": gpt.kv_heads, "ffn_hidden": gpt.ffn_hidden, "gated_mlp": gpt.gated_mlp}


def block_seconds(d_model, heads, seq_len, batch, repeats=BLOCK_REPEATS, device="cpu",
                  shape=None):
    """The median forward and backward of one block (of `shape`: shape_of's keywords) on
    `batch` sequences, in this process with its torch threads as they are, on `device`
    (a GPU: waited for)."""
    import torch

    from strategies.model.models import Block
    device = torch.device(device)
    torch.manual_seed(0)
    block = Block(d_model, heads, **(shape or {})).to(device)
    x = torch.randn(batch, seq_len, d_model, requires_grad=True, device=device)
    return statistics.median(timed_blocks(block, x, repeats, device))


def ends_seconds(vocab, d_model, heads, seq_len, batch, repeats=BLOCK_REPEATS, device="cpu",
                 shape=None):
    """The median forward, loss and backward of the model's ends (timed_ends) on `batch`
    sequences, in this process, as block_seconds times a block."""
    import torch

    from strategies.model.models import GPT
    device = torch.device(device)
    torch.manual_seed(0)
    ends = GPT(vocab, seq_len, 0, d_model, heads, **(shape or {})).to(device)
    tokens = torch.randint(0, vocab, (batch, seq_len), device=device)
    return statistics.median(timed_ends(ends, tokens, repeats, device))


def timed_blocks(block, x, repeats, device, warm_up=1):
    """Seconds of each forward and backward of `block` on x, `repeats` after `warm_up`
    that warm the allocator up (on a GPU: waited for)."""
    from strategies.runtime.metrics import now
    times = []
    for _ in range(repeats + warm_up):
        start = now(device)
        block(x).sum().backward()
        times.append(now(device) - start)
    return times[warm_up:]


def timed_ends(ends, tokens, repeats, device, warm_up=1):
    """Seconds of each forward, loss and backward of the model's ends (a GPT with no
    block) on `tokens`, the next-token loss on the tokens themselves (its cost is
    the same), `repeats` after `warm_up`."""
    from strategies.runtime.metrics import now
    times = []
    for _ in range(repeats + warm_up):
        start = now(device)
        ends.criterion(ends(tokens), tokens).backward()
        times.append(now(device) - start)
    return times[warm_up:]


class LocalOnly:
    """A tp collective that moves nothing and keeps the shapes (allgather: the shard
    t times; reduce_scatter: the first t-th): the tp block's own compute, timed."""

    def __init__(self, size):
        self.size = size

    def allreduce(self, x, op="sum"):
        return x

    def allgather(self, shard, n=None):
        return shard.repeat(self.size)

    def reduce_scatter(self, whole, op="sum"):
        return whole[:whole.numel() // self.size].clone()


def crossed(block, exchange):
    """`block` with exchange() at the start of its forward and at the end of its
    backward, where ZeRO-3 gathers a layer's parameters (strategies/sync/zero.py)."""
    import torch

    class Exchange(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            exchange()
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            exchange()
            return grad
    return lambda x: block(Exchange.apply(x))


class SizeProbe:
    """Everything the probe times at one micro-batch size, a round at a time
    (probe() runs a round of every size in turn): the block among all ranks; with
    `pair` (the ranks in twos, their ring), the pair all-reduce's wait; with `groups`
    ({t: (ranks in groups of t, their ring)}), a sequence-parallel block
    (strategies/parallel) over the ring and over LocalOnly, and with `replays` each
    also recomputed; with `across` ({t: the ranks t apart, their ring}), the ring's
    block crossed with the other groups.  Every rank keeps its own times; result()
    gives the slowest rank's means."""

    def __init__(self, world, d_model, heads, seq_len, batch, device, pair=None, groups=None,
                 replays=False, shape=None, vocab=None, across=None):
        import numpy as np
        import torch

        from strategies.model.models import GPT, Block
        self.world, self.device, self.pair = world, torch.device(device), pair
        torch.manual_seed(0)
        shape = shape or {}
        self.block = Block(d_model, heads, **shape).to(self.device)
        self.x = torch.randn(batch, seq_len, d_model, requires_grad=True, device=self.device)
        # the model's ends: the trainer's GPT without its blocks, on token ids
        self.ends = GPT(vocab, seq_len, 0, d_model, heads, **shape).to(self.device) \
            if vocab else None
        self.tokens = torch.randint(0, vocab or 1, (batch, seq_len), device=self.device)
        self.values = np.zeros(batch * seq_len * d_model, np.float32)
        if pair is not None and pair[1] is not None:
            for _ in range(WARM_UP):            # the ring's buffers, at this size
                pair[1].allreduce(self.values)
        guess = max(world.allgather(statistics.median(
            timed_blocks(self.block, self.x, 2, self.device))))
        total = min(MAX_REPEATS, max(BLOCK_REPEATS, math.ceil(SHARED_S / guess)))
        self.repeats = math.ceil(total / ROUNDS)
        self.times = {"block": [], "ends": [], "after compute": [], "polling": []}
        self.tp = {}
        # alternated in each round (the machine drifts): local, ring, and recomputed
        self.tp_kinds = [("local", False), ("ring", False)] + \
            ([("local", True), ("ring", True)] if replays else [])
        for t, (group, ring) in (groups or {}).items():
            colls = {"ring": ring, "local": LocalOnly(t)}
            blocks = {(name, replayed): self.tp_block(colls[name], group.rank, t, d_model,
                                                      heads, replayed, shape)
                      for name, replayed in self.tp_kinds}
            if t in (across or {}):     # the ring's block, crossed with the other groups
                values = np.zeros(batch * seq_len // t * d_model, np.float32)
                blocks["crossed", False] = crossed(
                    blocks["ring", False], lambda ring=across[t][1], v=values: ring.alltoall(v))
                self.times["crossed", False, t] = []
            x = torch.randn(batch, seq_len // t, d_model, requires_grad=True)
            # each kind's round as long as the whole block's SHARED_S: t times the
            # (smaller) blocks, cut into SLICES slices
            repeats = min(MAX_REPEATS, max(10, math.ceil(SHARED_S * t / guess)))
            self.tp[t] = (blocks, x, max(3, math.ceil(repeats / SLICES)))
            self.times.update({(name, replayed, t): [] for name, replayed in self.tp_kinds})

    @staticmethod
    def tp_block(coll, rank, t, d_model, heads, replayed=False, shape=None):
        """One Block split over t ranks with sequence parallelism, over `coll`; replayed:
        checkpointed as the trainer's --recompute checkpoints it."""
        import torch

        from strategies.model.models import Block
        from strategies.parallel.recompute import Recompute
        from strategies.parallel.sequence_parallel import split_sequence
        from strategies.parallel.tensor_parallel import TensorParallel, parallelize_blocks
        torch.manual_seed(0)
        tp = TensorParallel(coll, rank, t)
        block = Block(d_model, heads, **(shape or {}))
        parallelize_blocks([block], tp)
        blocks = split_sequence([("blocks.0", block)], tp)
        if replayed:
            Recompute.of_blocks(blocks)
        return blocks[0][1]

    def round(self):
        self.world.Barrier()
        self.times["block"] += timed_blocks(self.block, self.x, self.repeats, self.device,
                                            warm_up=0)
        if self.ends is not None:
            self.world.Barrier()
            self.times["ends"] += timed_ends(self.ends, self.tokens, self.repeats, self.device)
        if self.pair is not None:
            self.pair_all_reduces(compute=False)
            self.pair_all_reduces(compute=True)
        # The kinds of a tp block alternate slice by slice, and each slice keeps its
        # mean: what the ring adds to a block (and a replay to that) is a difference
        # of two kinds, taken within a slice, so both saw the same stretch of the
        # machine.  Timed one kind a round, a replay's wait (a difference of four
        # means) went 0-2.0 ms an exchange from probe to probe at one micro-batch size.
        for t, (blocks, x, repeats) in self.tp.items():
            for _ in range(SLICES):
                for name, replayed in blocks:
                    self.world.Barrier()
                    self.times[name, replayed, t].append(statistics.fmean(
                        timed_blocks(blocks[name, replayed], x, repeats, self.device)))

    def pair_all_reduces(self, compute):
        """A round's share of CALLS all-reduces of b s h values with the partner, each
        right after a block's forward (compute) or back to back, when every rank is
        polling and nobody waits."""
        import torch
        _, ring = self.pair
        for _ in range(math.ceil(CALLS / ROUNDS)):
            if compute:
                with torch.no_grad():
                    self.block(self.x)
            start = time.perf_counter()
            if ring is not None:
                ring.allreduce(self.values)
            self.times["after compute" if compute else "polling"].append(
                time.perf_counter() - start)

    def result(self):
        """Shared: the slowest rank's means over every round."""
        def slowest(value):
            return max(self.world.allgather(value))
        mean = {kind: statistics.fmean(times) for kind, times in self.times.items() if times}
        # the mean, not the median: a step pays every wait, and where the pair falls in
        # and out of step with the scheduler the waits take two values (0.1 and 1 ms at
        # b1 here), whose median is one or the other
        wait = mean["after compute"] - mean["polling"] if self.pair is not None else 0.0
        return Shared(slowest(mean["block"]), slowest(max(0.0, wait)),
                      tuple(self.tp_result(t, slowest) for t in self.tp),
                      slowest(mean["ends"]) if "ends" in mean else None)

    def tp_result(self, t, slowest):
        """TpBlock of groups of t from the slices' means: the local block, and what the
        ring adds to it, what recomputing adds locally and what the ring adds to that,
        each the interquartile mean over slices of a difference within a slice (a
        slice the machine gave to other work falls in the cut quarters), each the
        slowest rank's."""
        def robust(kinds):
            per_slice = [sum(sign * self.times[name, replayed, t][i]
                             for sign, (name, replayed) in kinds)
                         for i in range(len(self.times["local", False, t]))]
            return slowest(interquartile_mean(per_slice))
        local = robust([(1, ("local", False))])
        ring = local + max(0.0, robust([(1, ("ring", False)), (-1, ("local", False))]))
        crossed_s = ring + max(0.0, robust([(1, ("crossed", False)), (-1, ("ring", False))])) \
            if ("crossed", False, t) in self.times else None
        if ("local", True) not in self.tp_kinds:
            return TpBlock(t, ring, local, crossed_s=crossed_s)
        recompute = robust([(1, ("local", True)), (-1, ("local", False))])
        replay_comm = robust([(1, ("ring", True)), (-1, ("ring", False)),
                              (-1, ("local", True)), (1, ("local", False))])
        return TpBlock(t, ring, local, ring + recompute + max(0.0, replay_comm),
                       local + recompute, crossed_s)


def pair_link(world, device):
    """On every rank: (alpha, beta) of the trainer's ring between the ranks of a pair
    on `device`, fitted to LINK_SIZES; the slowest pair's times (None: one rank)."""
    import torch

    import allreduce
    from strategies.runtime.metrics import now
    from strategies.sync.gradient_sync import for_device
    device = torch.device(device)
    pair = world.Split(world.rank // 2, world.rank)
    ring = for_device(allreduce.create("ring", comm=pair, device=device), device) \
        if pair.size > 1 else None
    seconds = []
    for n, calls in LINK_SIZES:
        x = torch.zeros(n // 4, dtype=torch.float32, device=device)
        times = []
        for _ in range(calls + 2):          # the first two map, pin and warm up
            world.Barrier()
            start = now(device)
            if ring is not None:
                ring.allreduce(x)
            times.append(now(device) - start)
        seconds.append(max(world.allgather(statistics.median(times[2:]))))
    return fit_link(list(zip([n for n, _ in LINK_SIZES], seconds)))


def fit_link(points):
    """(alpha, beta) from [(bytes, s) small, (bytes, s) large] of a ring all-reduce
    at P = 2: two steps of n / 2 bytes each way, t(n) = 2 alpha + n beta."""
    (n1, t1), (n2, t2) = points
    beta = max(t2 - t1, 0.0) / (n2 - n1)
    return max(t1 - n1 * beta, 0.0) / 2, beta


def ring_groups(world, sizes, apart=False):
    """{t: (the world's ranks in groups of t, the trainer's ring on each)}; apart: the
    ranks t apart instead (world / t of them, one from each group of t)."""
    import allreduce
    groups = {}
    for t in sizes:
        group = world.Split(world.rank % t, world.rank) if apart else \
            world.Split(world.rank // t, world.rank)
        groups[t] = (group, allreduce.create("ring", comm=group) if group.size > 1 else None)
    return groups


def probe(d_model, heads, seq_len, batches, threads, device="cpu", link=False, tp_max=None,
          replays=False, shape=None, vocab=None):
    """On every rank of an MPI job on one host: Probed, the same on every rank.  On a
    GPU the ranks share it (strategies.train's --device cuda: local rank i on GPU
    i mod the GPUs) and wait for no core.  replays: the tp blocks recomputed too."""
    import torch
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    torch.set_num_threads(threads)
    if device == "cuda":
        local = world.Split_type(MPI.COMM_TYPE_SHARED).rank
        device = f"cuda:{local % torch.cuda.device_count()}"
    sharing = device == "cpu" and world.size > (os.cpu_count() or 1)   # ranks > cores
    pair = ring_groups(world, [2])[2] if sharing else None
    shape = shape or {}
    splits = (seq_len, heads, shape.get("kv_heads") or heads,
              shape.get("ffn_hidden") or 4 * d_model)     # what tp cuts
    tp_sizes = [t for t in range(2, min(tp_max or 1, world.size) + 1)
                if world.size % t == 0 and all(n % t == 0 for n in splits)] \
        if device == "cpu" else []
    groups = ring_groups(world, tp_sizes)
    # where the ranks make two groups of t at least, the ranks t apart: a context
    # group's or ZeRO-3's replicas beside tp (6.)
    across = ring_groups(world, [t for t in tp_sizes if world.size >= 2 * t], apart=True)
    sizes = {b: SizeProbe(world, d_model, heads, seq_len, b, device, pair, groups, replays,
                          shape, vocab, across) for b in batches}
    # All compute at once, as in the run, for SHARED_S at least: a block of a small
    # micro-batch takes about a time slice, so a few of them are each timed either
    # on a core of its own or sharing one, and their median is one or the other (the
    # prediction of one layout moved 0.091-0.124 s from probe to probe while its runs
    # measured 0.123-0.139 s).  Over many slices the mean is the rate a rank gets.
    # And in rounds through every size: this machine's speed drifts over tens of
    # seconds (a run's steps of one layout took 3.1-5.5 s), so each size's figures
    # are spread over the whole probe, not taken in one stretch of it.
    for _ in range(ROUNDS):
        for size in sizes.values():
            size.round()
    return Probed({b: size.result() for b, size in sizes.items()},
                  pair_link(world, device) if link else None)


def measure(gpt, ranks, batches, threads, device="cpu", timeout=600, link=False,
            tp_max=None, replays=False):
    """Probed on this host with `ranks` ranks of `threads` threads computing on
    `device` (cpu, or cuda: the host's GPUs) at micro-batches of each of `batches`
    sequences, launched through mpiexec; with `link` the device path's alpha and
    beta too; tp blocks in groups of up to tp_max ranks, with `replays` also
    recomputed."""
    argv = [mpiexec_path(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
            "experiments.planner.shared_cores", "--d-model", str(gpt.d_model), "--heads",
            str(gpt.heads), "--seq-len", str(gpt.seq_len),
            "--kv-heads", str(gpt.kv_heads), "--ffn-hidden", str(gpt.ffn_hidden),
            "--vocab", str(gpt.vocab),
            "--batches", ",".join(str(b) for b in batches), "--threads", str(threads),
            "--device", device] + (["--gated-mlp"] if gpt.gated_mlp else []) \
        + (["--link"] if link else []) \
        + (["--tp-max", str(tp_max)] if tp_max else []) + (["--replays"] if replays else [])
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        raise RuntimeError(f"the shared-cores probe failed (exit {done.returncode}): "
                           f"{lines[-1]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return Probed({int(b): Shared(s["block_s"], s["wait_s"],
                                  tuple(TpBlock(*row) for row in s["tp_blocks"]),
                                  s.get("ends_s"))
                   for b, s in found["sizes"].items()},
                  tuple(found["link"] or ()) or None)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.planner.shared_cores",
                                 description=__doc__.split("\n")[0])
    for name in ("d-model", "heads", "seq-len"):
        ap.add_argument(f"--{name}", type=int, required=True, help=f"the model's {name}")
    ap.add_argument("--kv-heads", type=int, help="key-value heads (default: the heads)")
    ap.add_argument("--ffn-hidden", type=int, help="the MLP's width (default: 4 x d-model)")
    ap.add_argument("--gated-mlp", action="store_true", help="a SwiGLU MLP")
    ap.add_argument("--vocab", type=int, help="also time the model's ends at this vocabulary")
    ap.add_argument("--batches", type=lambda text: [int(b) for b in text.split(",")],
                    required=True, help="micro-batch sizes, comma-separated: 1,2,4,8")
    ap.add_argument("--threads", type=int, default=1, help="torch threads a rank")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the ranks compute (cuda: sharing the host's GPUs)")
    ap.add_argument("--link", action="store_true",
                    help="also fit alpha and beta of the trainer's ring between pairs on --device")
    ap.add_argument("--tp-max", type=int, help="also time tp blocks in groups of up to "
                    "this many ranks (on the CPU)")
    ap.add_argument("--replays", action="store_true",
                    help="also time the tp blocks recomputed (the trainer's --recompute)")
    a = ap.parse_args(argv)
    found = probe(a.d_model, a.heads, a.seq_len, a.batches, a.threads, a.device, a.link,
                  a.tp_max, a.replays, {"kv_heads": a.kv_heads, "ffn_hidden": a.ffn_hidden,
                                        "gated_mlp": a.gated_mlp}, a.vocab)
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps({"sizes": {b: s._asdict() for b, s in found.sizes.items()},
                          "link": found.link, "ranks": MPI.COMM_WORLD.size}), flush=True)


if __name__ == "__main__":
    main()
