"""A small training run through psrv: linear regression, data sharded over the workers.

    mpiexec -n 3 python -m mpi4py -m psrv.example --servers 1        # 2 workers, 1 server
    mpiexec -n 5 python -m mpi4py -m psrv.example --servers 2 --consistency ssp --staleness 1

    # standalone on one host: start the servers, then one worker per process
    python -m psrv.server --shard 0 --num-shards 1 --bind tcp://127.0.0.1:5555 &
    python -m psrv.example --ps tcp://127.0.0.1:5555 --worker-id 0 --num-workers 2 &
    python -m psrv.example --ps tcp://127.0.0.1:5555 --worker-id 1 --num-workers 2

    # across hosts: CURVE keys, servers on h1 and h2, the workers under mpiexec
    # (worker id and count are the MPI rank and size unless given)
    python -m psrv.keys keys --workers 8
    python -m psrv.server --shard 0 --num-shards 2 --bind tcp://0.0.0.0:5555 --keys keys   # on h1
    python -m psrv.server --shard 1 --num-shards 2 --bind tcp://0.0.0.0:5556 --keys keys   # on h2
    mpiexec -f hostfile -n 8 python -m mpi4py -m psrv.example --ps tcp://h1:5555,tcp://h2:5556 --keys keys

    # under mpiexec across hosts, servers included: keys are made and exchanged by itself
    mpiexec -f hostfile -n 5 python -m mpi4py -m psrv.example --servers 1 --bind-host 0.0.0.0

Worker 0 prints one JSON line: the losses, and (BSP only) the largest difference
from the same SGD run done serially on the global batch, which BSP must reproduce.
"""
import argparse
import json
import logging
import math
import os
import sys

import numpy as np

from .client import Client
from .config import Consistency, OptimizerConfig
from .keys import load_worker_keys

MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def data(n=96, dim=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    w_true = rng.standard_normal(dim).astype(np.float32)
    return x, x @ w_true + np.float32(0.5)


def grads(params, x, y):
    """Mean-squared error 0.5 * mean((x w + b - y)^2) and its gradient."""
    err = x @ params["w"] + params["b"][0] - y
    return float(0.5 * np.mean(err * err)), {"w": (x.T @ err / len(y)).astype(np.float32),
                                              "b": np.array([err.mean()], np.float32)}


def initial_params(dim):
    return {"w": np.zeros(dim, np.float32), "b": np.zeros(1, np.float32)}


def serial(steps, lr, x, y):
    params = initial_params(x.shape[1])
    for _ in range(steps):
        _, g = grads(params, x, y)
        for k in params:
            params[k] -= np.float32(lr) * g[k]
    return params


def train(client, worker_id, num_workers, steps, lr, consistency):
    x, y = data()
    mine = slice(worker_id * len(y) // num_workers, (worker_id + 1) * len(y) // num_workers)
    params = initial_params(x.shape[1])
    start = client.init(params, OptimizerConfig("sgd", lr=lr), consistency)
    losses = []
    for step in range(start, steps):
        loss, g = grads(params, x[mine], y[mine])
        losses.append(loss)
        client.push_pull(g, params, step).wait()
    result = {"worker": worker_id, "losses": [round(v, 6) for v in losses],
              "staleness": client.stats()["histogram"]}
    if consistency.mode == "bsp":
        ref = serial(steps, lr, x, y)
        result["max_abs_diff_vs_serial"] = max(float(np.abs(params[k] - ref[k]).max()) for k in ref)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=1, help="under mpiexec: the last S ranks serve")
    ap.add_argument("--bind-host", default="127.0.0.1",
                    help="under mpiexec: where servers listen (off loopback: CURVE, keys exchanged)")
    ap.add_argument("--ps", help="standalone: comma-separated server endpoints")
    ap.add_argument("--keys", help="standalone: directory from python -m psrv.keys")
    ap.add_argument("--worker-id", type=int, help="default: the MPI rank under mpiexec, else 0")
    ap.add_argument("--num-workers", type=int, help="default: the MPI size under mpiexec, else 1")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--consistency", default="bsp", choices=("bsp", "ssp", "asp"),
                    help="the servers' consistency model (config.Consistency)")
    ap.add_argument("--staleness", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0)
    a = ap.parse_args(argv)
    try:                                              # every value, before any work
        consistency = Consistency(a.consistency, a.staleness)
        check_options(a)
    except ValueError as e:
        ap.exit(2, f"psrv.example: {e}\n")
    if a.ps:
        rank, size = mpi_rank_and_size()
        worker_id = rank if a.worker_id is None else a.worker_id
        num_workers = size if a.num_workers is None else a.num_workers
        endpoints = a.ps.split(",")
        try:
            keys = load_worker_keys(a.keys, worker_id) if a.keys else None
        except ValueError as e:
            ap.exit(2, f"psrv.example: --keys: {e}\n")
    else:
        from mpi4py import MPI                        # distributed-only: roles from the ranks
        from .launch import mpi_roles
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,   # server ranks log here
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        # the keys are known before the servers start: each shard's receive queue holds
        # one step's messages of a worker (launch.step_messages)
        shapes = {n: p.shape for n, p in initial_params(data()[0].shape[1]).items()}
        role = mpi_roles(MPI.COMM_WORLD, num_servers=a.servers, bind_host=a.bind_host,
                         shapes=shapes, worker_timeout=a.timeout)
        if role.is_server:
            role.serve()
            return
        endpoints, worker_id, num_workers = role.endpoints, role.worker_id, role.num_workers
        keys = role.keys
    try:
        client = Client(endpoints, worker_id, num_workers, timeout=a.timeout, keys=keys)
    except ValueError as e:
        ap.exit(2, f"psrv.example: {e}\n")           # a bad launch: exit 2 with the reason
    with client:
        result = train(client, worker_id, num_workers, a.steps, a.lr, consistency)
    if worker_id == 0:
        print(json.dumps(result), flush=True)


def check_options(a):
    """ValueError naming the first bad flag (the parsed argparse namespace a)."""
    if not 0 < a.lr < math.inf:
        raise ValueError(f"--lr must be finite and > 0, got {a.lr}")
    if not 0 < a.timeout < math.inf:
        raise ValueError(f"--timeout must be finite and > 0 seconds, got {a.timeout}")
    for flag, value, least in (("--steps", a.steps, 0), ("--servers", a.servers, 1),
                               ("--worker-id", a.worker_id, 0),
                               ("--num-workers", a.num_workers, 1)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if None not in (a.worker_id, a.num_workers) and a.worker_id >= a.num_workers:
        raise ValueError(f"--worker-id {a.worker_id} is not below --num-workers {a.num_workers}")
    if a.ps is not None and not all(a.ps.split(",")):
        raise ValueError(f"--ps {a.ps!r}: an empty endpoint")


def mpi_rank_and_size():
    """(rank, size) of COMM_WORLD when launched by mpiexec (or under python -m mpi4py),
    else (0, 1) without initialising MPI."""
    if "mpi4py" not in sys.modules and not any(v in os.environ for v in MPI_RANK_VARIABLES):
        return 0, 1
    from mpi4py import MPI                            # distributed-only
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


if __name__ == "__main__":
    main()
