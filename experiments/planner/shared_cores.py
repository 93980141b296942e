"""What sharing this host's cores costs a rank: its compute rate among the other
ranks, and an exchange's wait for its peer's turn on a core.

    mpiexec -n 4 python -m mpi4py -m experiments.planner.shared_cores --d-model 128 \
        --heads 4 --seq-len 64 --batch 8 --threads 1   # {"block_s": ..., "wait_s": ...}
    found = shared_cores.measure(gpt, ranks=4, batch=8, threads=1)   # the same, from Python

On the machine at hand the planner's "GPUs" are MPI ranks on CPU cores, or ranks
sharing its GPUs (verify.py).  A cluster gives every rank a device of its own; here
the ranks share the cores, the caches and the memory bandwidth (or the GPU), and
the probe measures what that costs with every rank of the run there at once:

1. The rate.  Every rank times a transformer block's forward and backward at the
   model's shape (strategies/model/models.py's Block), all ranks together, with
   the threads the trainer gives each.  A synchronous step goes at the pace of its
   slowest rank, so the probe reports the slowest rank's mean over half a second
   of blocks at least (SHARED_S: many time slices, where a few blocks would each
   fall on one side of a slice or the other).  Timed alone in
   one process and scaled by the ranks' share of the cores instead, a block of
   the 4-layer GPT in docs/planner.md took 4.9 ms x 2 = 9.8 ms, where 4 ranks on
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

from allreduce.records import checkout_pythonpath

from experiments.records import mpiexec_path

CALLS = 120         # all-reduces a kind, the first WARM_UP left out
WARM_UP = 8
BLOCK_REPEATS = 15  # a block's forward and backward, after one that warms up
SHARED_S = 0.5      # ... and at least this long, where ranks share the cores
MAX_REPEATS = 2000
LINK_SIZES = ((4 << 10, 120), (16 << 20, 20))     # (bytes, all-reduces) the link is fitted to


class Shared(NamedTuple):
    block_s: float      # the slowest rank's forward and backward of one block
    wait_s: float       # a pair all-reduce's wait after compute (0: a core for every rank)
    link: tuple = None  # (alpha s, beta s a byte) of the device path (--link), or None


def block_seconds(d_model, heads, seq_len, batch, repeats=BLOCK_REPEATS, device="cpu",
                  typical=statistics.median):
    """The median (or `typical`) forward and backward of one block on `batch`
    sequences, in this process with its torch threads as they are, on `device` (a
    GPU: waited for)."""
    import torch

    from strategies.model.models import Block
    from strategies.runtime.metrics import now
    device = torch.device(device)
    torch.manual_seed(0)
    block = Block(d_model, heads).to(device)
    x = torch.randn(batch, seq_len, d_model, requires_grad=True, device=device)
    times = []
    for _ in range(repeats + 1):                 # the first warms the allocator up
        start = now(device)
        block(x).sum().backward()
        times.append(now(device) - start)
    return typical(times[1:])


def pair_wait(world, d_model, heads, seq_len, batch):
    """On every rank: the wait per pair all-reduce after compute, in s (0 alone)."""
    import numpy as np
    import torch

    import allreduce
    from strategies.model.models import Block
    pair = world.Split(world.rank // 2, world.rank)
    ring = allreduce.create("ring", comm=pair) if pair.size > 1 else None
    block = Block(d_model, heads)
    x = torch.randn(batch, seq_len, d_model)
    values = np.zeros(batch * seq_len * d_model, np.float32)

    def timed(compute):
        times = []
        for _ in range(CALLS):
            if compute:
                with torch.no_grad():
                    block(x)
            start = time.perf_counter()
            if ring is not None:
                ring.allreduce(values)
            times.append(time.perf_counter() - start)
        # the mean, not the median: a step pays every wait, and where the pair falls in
        # and out of step with the scheduler the waits take two values (0.1 and 1 ms at
        # b1 here), whose median is one or the other
        return statistics.fmean(times[WARM_UP:])

    world.Barrier()
    polling = timed(False)
    return max(0.0, timed(True) - polling)


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
    if ring is None and world.size == 1:
        return None
    return fit_link(list(zip([n for n, _ in LINK_SIZES], seconds)))


def fit_link(points):
    """(alpha, beta) from [(bytes, s) small, (bytes, s) large] of a ring all-reduce
    at P = 2: two steps of n / 2 bytes each way, t(n) = 2 alpha + n beta."""
    (n1, t1), (n2, t2) = points
    beta = max(t2 - t1, 0.0) / (n2 - n1)
    return max(t1 - n1 * beta, 0.0) / 2, beta


def probe(d_model, heads, seq_len, batch, threads, device="cpu", link=False):
    """On every rank of an MPI job on one host: Shared, the same on every rank.  On a
    GPU the ranks share it (strategies.train's --device cuda: local rank i on GPU
    i mod the GPUs) and wait for no core."""
    import torch
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    torch.set_num_threads(threads)
    if device == "cuda":
        local = world.Split_type(MPI.COMM_TYPE_SHARED).rank
        device = f"cuda:{local % torch.cuda.device_count()}"
    # All compute at once, as in the run, for SHARED_S at least: a block of a small
    # micro-batch takes about a time slice, so a few of them are each timed either
    # on a core of its own or sharing one, and their median is one or the other (the
    # prediction of one layout moved 0.091-0.124 s from probe to probe while its runs
    # measured 0.123-0.139 s).  Over many slices the mean is the rate a rank gets.
    guess = block_seconds(d_model, heads, seq_len, batch, repeats=2, device=device)
    repeats = max(world.allgather(min(MAX_REPEATS, max(BLOCK_REPEATS,
                                                       math.ceil(SHARED_S / guess)))))
    world.Barrier()
    block_s = max(world.allgather(block_seconds(d_model, heads, seq_len, batch, repeats,
                                                device, typical=statistics.fmean)))
    wait_s = 0.0
    if device == "cpu" and world.size > (os.cpu_count() or 1):
        wait_s = max(world.allgather(pair_wait(world, d_model, heads, seq_len, batch)))
    return Shared(block_s, wait_s, pair_link(world, device) if link else None)


def measure(gpt, ranks, batch, threads, device="cpu", timeout=300, link=False):
    """Shared on this host with `ranks` ranks of `threads` threads computing on
    `device` (cpu, or cuda: the host's GPUs), launched through mpiexec; with `link`
    the device path's alpha and beta too."""
    argv = [mpiexec_path(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
            "experiments.planner.shared_cores", "--d-model", str(gpt.d_model), "--heads",
            str(gpt.heads), "--seq-len", str(gpt.seq_len), "--batch", str(batch),
            "--threads", str(threads), "--device", device] + (["--link"] if link else [])
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        raise RuntimeError(f"the shared-cores probe failed (exit {done.returncode}): "
                           f"{lines[-1]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return Shared(found["block_s"], found["wait_s"], tuple(found["link"] or ()) or None)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.planner.shared_cores",
                                 description=__doc__.split("\n")[0])
    for name in ("d-model", "heads", "seq-len", "batch"):
        ap.add_argument(f"--{name}", type=int, required=True, help=f"the model's {name}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads a rank")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the ranks compute (cuda: sharing the host's GPUs)")
    ap.add_argument("--link", action="store_true",
                    help="also fit alpha and beta of the trainer's ring between pairs on --device")
    a = ap.parse_args(argv)
    found = probe(a.d_model, a.heads, a.seq_len, a.batch, a.threads, a.device, a.link)
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps({**found._asdict(), "ranks": MPI.COMM_WORLD.size}), flush=True)


if __name__ == "__main__":
    main()
