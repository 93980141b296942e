"""A rank's wait for its peer's turn on a shared core: what a tensor-parallel
all-reduce costs on the machine at hand when it runs more ranks than cores.

    mpiexec -n 4 python -m mpi4py -m experiments.planner.core_wait --d-model 128 \
        --heads 4 --seq-len 64 --batch 8        # prints {"wait_s": ..., ...}
    wait = core_wait.measure(gpt, ranks=4, batch=8)  # the same, launched from Python

On a GPU every rank has its own device.  On CPU cores shared by more ranks than
there are cores, a rank that reaches a blocking exchange right after computing
finds its peer descheduled, running someone else's compute, and waits for the
scheduler to give the peer its next turn: about a time slice, milliseconds,
where the link itself takes microseconds.  Megatron's tensor parallelism puts
two all-reduces in every layer's forward and two in its backward, each right
after the compute that feeds it, so on such a machine each one pays that wait.

The probe reproduces the pattern: ranks in pairs (a tp group of 2), every rank
runs a block's forward at the model's shape and then all-reduces b s h values
with its partner, through the ring the trainer uses; again with no compute in
between, when every rank is polling and nobody waits.  The wait is the median
all-reduce after compute less the median without, taken on the slowest rank.
A tp group of t ranks makes 2 (t - 1) exchanges an all-reduce, t - 1 times the
pair's (step.py).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from allreduce.records import checkout_pythonpath

from experiments.records import mpiexec_path

CALLS = 40          # all-reduces a kind, the first WARM_UP left out
WARM_UP = 8


def probe(d_model, heads, seq_len, batch):
    """On every rank of an MPI job (even size): the wait per pair all-reduce, in s."""
    import numpy as np
    import torch
    from mpi4py import MPI

    import allreduce
    from strategies.model.models import Block
    world = MPI.COMM_WORLD
    if world.size % 2:
        raise SystemExit("core_wait: the ranks go in pairs, so their number must be even")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pair = world.Split(world.rank // 2, world.rank)
    ring = allreduce.create("ring", comm=pair)
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
            ring.allreduce(values)
            times.append(time.perf_counter() - start)
        return statistics.median(times[WARM_UP:])

    world.Barrier()
    polling = timed(False)
    after_compute = timed(True)
    waits = world.allgather(after_compute - polling)
    return max(0.0, max(waits))


def measure(gpt, ranks, batch, timeout=300):
    """The wait (s) on this host with `ranks` ranks (rounded up to even), launched
    through mpiexec; 0.0 where the host has a core for every rank."""
    if ranks <= (os.cpu_count() or 1):
        return 0.0
    ranks += ranks % 2
    argv = [mpiexec_path(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
            "experiments.planner.core_wait", "--d-model", str(gpt.d_model), "--heads",
            str(gpt.heads), "--seq-len", str(gpt.seq_len), "--batch", str(batch)]
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        raise RuntimeError(f"the core-wait probe failed (exit {done.returncode}): {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["wait_s"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.planner.core_wait",
                                 description=__doc__.split("\n")[0])
    for name in ("d-model", "heads", "seq-len", "batch"):
        ap.add_argument(f"--{name}", type=int, required=True, help=f"the model's {name}")
    a = ap.parse_args(argv)
    wait = probe(a.d_model, a.heads, a.seq_len, a.batch)
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps({"wait_s": wait, "ranks": MPI.COMM_WORLD.size}), flush=True)


if __name__ == "__main__":
    main()
