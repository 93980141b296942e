"""psrv.launch.mpi_roles(await_keys=True) under `mpiexec -n 3` (ranks 0, 1 train, rank 2
serves): the shard binds once the workers have declared their keys, with a receive
queue of one step's messages of a worker counted from them; the workers then train a
step through it.  `silent`: the workers never declare, and the server ends after its
join timeout naming rank 0, instead of waiting for ever.  `signalled`: they never
declare and the server gets SIGINT: it ends at once, saying so, without a traceback.
`unbindable`: the servers' host is not this host's, so the bind fails: every worker's
declare raises PSError naming the server and the reason.  `unstartable`: a bad server
option: every rank raises PSError naming the shard, nobody waits."""
import logging
import os
import signal
import sys
import threading

import numpy as np
from mpi4py import MPI

import psrv
from psrv.launch import mpi_roles

SHAPES = {f"w{i}": (100 + i,) for i in range(6)}      # 2 x 6 keys + 4 = 16 messages a step

logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                    format="%(name)s %(levelname)s %(message)s")
mode = sys.argv[1] if len(sys.argv) > 1 else "declare"
options = {"unbindable": {"bind_host": "192.0.2.1"},      # TEST-NET-1: nobody's address
           "unstartable": {"worker_timeout": -1.0}}.get(mode, {})
try:
    role = mpi_roles(MPI.COMM_WORLD, num_servers=1, await_keys=True,
                     keys_timeout=30.0 if mode == "signalled" else 2.0, **options)
except psrv.PSError as e:
    print(f"rank {MPI.COMM_WORLD.rank}: {e}", flush=True)
    sys.exit(0)
if role.is_server:
    if mode == "signalled":
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        role.serve()
    except (TimeoutError, psrv.PSError) as e:
        print(f"server: {e}", flush=True)
        sys.exit(1)
    print("server: returned", flush=True)
elif mode == "unbindable":
    try:
        role.declare(SHAPES, timeout=30)
    except psrv.PSError as e:
        print(f"worker {role.worker_id}: {e}", flush=True)
elif mode == "declare":
    assert role.endpoints is None                     # not before the keys are declared
    endpoints = role.declare(SHAPES, timeout=30)
    with psrv.Client(endpoints, role.worker_id, role.num_workers, timeout=30) as client:
        values = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
        client.init(values, psrv.OptimizerConfig(name="sgd", lr=1.0))
        grads = {k: np.full(s, role.worker_id + 1.0, np.float32) for k, s in SHAPES.items()}
        out = {k: np.empty(s, np.float32) for k, s in SHAPES.items()}
        client.push_pull(grads, out, 0).wait()
        assert all(np.allclose(v, -1.5) for v in out.values()), out  # -lr x mean(1, 2)
    if role.worker_id == 0:
        print("trained", flush=True)
