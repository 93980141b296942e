"""Tier (b): every collective of every algorithm against an independent reference.

    mpiexec -n P python -m mpi4py tests/mpi/collectives_matrix.py ['[{"algo": "ring"}, ...]']

Each spec is {"algo": name, "transport": "mpi"|"torch", "options": {...}}; the
default list covers all algorithms, hierarchical in two shapes, the ring
and tree over torch.distributed, auto in two node layouts, and shm.  Two optional keys:
  "split": "parity"    the collective runs over a sub-communicator of COMM_WORLD:
                       world ranks of equal parity (sizes 2 and 1 at P = 3);
           "reversed"  all ranks in reverse order (rank r is world rank P-1-r)
  "device": "cuda"     torch inputs live on the GPU; an MPI transport moves them
                       through host memory (allreduce.host_staged), NCCL directly
  "ipc": true          (with "device": "cuda") a textbook algorithm made for the GPU:
                       device to device between ranks that share it (cuda_ipc.py)
  "hold": true         (torch transport) every message is held until the next wait
                       and posted in one batch, as CUDA ones are for NCCL: the
                       holding checked on gloo, without a GPU

Inputs depend on rank and position (sin(0.37 i + 1.3 r)), never all ones, so a
chunk in the wrong place or from the wrong rank shows.  Every rank computes
every rank's input itself, and the reference in float64 from those, without
any communication.  Tolerances, for a sum of P values of magnitude <= 4 in a
dtype of machine epsilon eps: P * eps * 4P (P roundings of partial sums of
magnitude <= 4P, a full ulp each); integers, max and min: exact.  All ranks
must also hold bit-identical all-reduce results.
"""
import hashlib
import json
import sys

import numpy as np
import torch
from mpi4py import MPI

import allreduce
from allreduce.cuda_ipc import SharedGpuTransport
from allreduce.torch_transport import TorchTransport
from matrix_checks import NUMPY, TORCH, compare, expect_error, f64, failures, make, report

world = MPI.COMM_WORLD
SPECS = [{"algo": "ring"}, {"algo": "tree"}, {"algo": "halving_doubling"},
         {"algo": "hierarchical", "options": {"ranks_per_node": 2, "inner": "ring", "outer": "tree"}},
         {"algo": "hierarchical", "options": {"inner": "halving_doubling", "outer": "ring"}},
         {"algo": "mpi"}, {"algo": "torch"},
         {"algo": "ring", "transport": "torch"}, {"algo": "tree", "transport": "torch"},
         # auto: the library's below 128 KiB, then halving-doubling, the ring; two-node
         # layouts (ranks_per_node=2 at P = 3, 4) take the hierarchical one for BIG
         {"algo": "auto"}, {"algo": "auto", "options": {"ranks_per_node": 2}},
         # shm with private buffers: by the ring (tests/mpi/shm_window.py: its own path)
         {"algo": "shm"}]
specs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else SPECS

EPS = {"float32": 1.2e-7, "float64": 2.3e-16, "float16": 9.8e-4, "bfloat16": 7.9e-3}
BIG = 1_000_003


def digest(x):
    data = f64(x)  # every value here converts to float64 exactly
    return hashlib.sha1(data.tobytes()).hexdigest()


def run_case(coll, comm, kind, dtype, n, ops, device="cpu"):
    """Inputs are made from the rank in `comm`, the communicator of the collective."""
    rank, P = comm.rank, comm.size
    label = f"{coll.label} P={P} {kind} {dtype} n={n}"
    inputs = [f64(make(kind, dtype, r, n)) for r in range(P)]
    floating = not dtype.startswith("int")
    tol = P * EPS[dtype] * 4 * P if floating else 0
    bounds = allreduce.shard_bounds(n, P)
    a, b = bounds[rank]
    for op in ops:
        x = make(kind, dtype, rank, n, device)
        want = {"sum": sum(inputs), "avg": sum(inputs) / P,
                "max": np.max(inputs, axis=0), "min": np.min(inputs, axis=0)}[op]
        coll.allreduce(x, op=op)
        compare(f"{label} allreduce {op}", x, want, tol if op in ("sum", "avg") else 0)
        if op == "sum" and len(set(comm.allgather(digest(x)))) != 1:
            failures.append(f"{label} allreduce {op}: ranks hold different bits")
        if op == "min":
            continue                       # reduce-scatter shares the reduction code
        x = make(kind, dtype, rank, n, device)
        shard = coll.reduce_scatter(x, op=op)
        compare(f"{label} reduce_scatter {op}", shard, want[a:b],
                tol if op in ("sum", "avg") else 0)
        compare(f"{label} reduce_scatter leaves x", x, inputs[rank], 0)
    mine = make(kind, dtype, rank, n, device)[a:b]
    gathered = np.concatenate([inputs[r][slice(*bounds[r])] for r in range(P)])
    compare(f"{label} allgather(n)", coll.allgather(mine, n), gathered, 0)
    compare(f"{label} allgather(sizes exchanged)", coll.allgather(mine), gathered, 0)
    for root in sorted({0, P - 1}):
        x = make(kind, dtype, rank, n, device)
        coll.broadcast(x, root=root)
        compare(f"{label} broadcast root={root}", x, inputs[root], 0)


def check_algorithm(coll, comm, quick=False, device="cpu"):
    """quick: the algorithm's dtype handling is checked elsewhere; test the transport.
    On a GPU every torch dtype is checked: NCCL and the host staging are new paths."""
    P = comm.size
    small = sorted({0, 1, max(P - 1, 0), 2 * P + 1})   # empty, one, fewer than P, not divisible
    numpy_dtypes = ["float32", "int64"] if quick else NUMPY
    torch_dtypes = TORCH if device != "cpu" else ["bfloat16"] if quick else TORCH
    for n in small:
        for dtype in numpy_dtypes:
            ops = ["sum", "max", "min"] + (["avg"] if not dtype.startswith("int") else [])
            run_case(coll, comm, "numpy", dtype, n, ops)
        for dtype in torch_dtypes:
            ops = ["sum", "max"] + (["avg"] if not dtype.startswith("int") else [])
            run_case(coll, comm, "torch", dtype, n, ops, device)
    big = (("numpy", "float32"),) if quick else (("numpy", "float32"), ("numpy", "int64"),
                                                 ("torch", "bfloat16"))
    if device != "cpu":
        big += (("torch", "float32"),)
    for kind, dtype in big:
        run_case(coll, comm, kind, dtype, BIG, ["sum"], device)

    # Bad input: a clear error naming the problem.
    name = coll.label
    x = np.arange(20, dtype=np.float32)
    expect_error(f"{name} non-contiguous", lambda: coll.allreduce(x[::2]), "not C-contiguous")
    ro = np.arange(4, dtype=np.float32)
    ro.flags.writeable = False
    expect_error(f"{name} read-only", lambda: coll.allreduce(ro), "read-only")
    expect_error(f"{name} dtype", lambda: coll.allreduce(np.zeros(3, np.complex64)),
                 "unsupported dtype")
    expect_error(f"{name} torch dtype", lambda: coll.allreduce(torch.zeros(3, dtype=torch.uint8)),
                 "unsupported dtype")
    expect_error(f"{name} op", lambda: coll.allreduce(x, op="prod"), "unknown op 'prod'")
    expect_error(f"{name} int avg", lambda: coll.allreduce(np.arange(3), op="avg"),
                 "floating dtype")
    expect_error(f"{name} tensor non-contiguous", lambda: coll.allreduce(torch.zeros(4, 4).t()),
                 "not contiguous")
    expect_error(f"{name} root", lambda: coll.broadcast(x, root=P), "root")
    expect_error(f"{name} list", lambda: coll.allreduce([1, 2, 3]), "numpy array or a torch tensor")


class HoldEveryMessage(TorchTransport):
    def holds(self, tensor):
        return True


def communicator(split):
    if split == "parity":
        return world.Split(world.rank % 2, world.rank)
    if split == "reversed":
        return world.Split(0, -world.rank)
    return world


for spec in specs:
    comm = communicator(spec.get("split"))
    device = spec.get("device", "cpu")
    transport = spec.get("transport")
    if spec.get("hold"):
        made = allreduce.make_transport("torch", comm)
        transport = HoldEveryMessage(made.group, made.timeout)
    coll = allreduce.create(spec["algo"], comm=comm, transport=transport,
                            device=torch.device(device) if spec.get("ipc") else None,
                            **spec.get("options", {}))
    if spec.get("ipc"):        # ranks that share the GPU: device to device (cuda_ipc.py)
        assert isinstance(coll.transport, SharedGpuTransport), coll.transport
    if device != "cpu":
        coll = allreduce.host_staged(coll)
    coll.label = spec["algo"] + (f"@{spec['transport']}" if spec.get("transport") else "") + (
        " holding every message" if spec.get("hold") else "") + (
        " over CUDA IPC" if spec.get("ipc") else "") + (
        f"{spec['options']}" if spec.get("options") else "") + (
        f" split={spec['split']} (world ranks {comm.allgather(world.rank)})"
        if spec.get("split") else "") + (f" on {device}" if device != "cpu" else "")
    check_algorithm(coll, comm, quick=spec.get("transport") == "torch", device=device)
    world.Barrier()
    if world.rank == 0:
        print(f"checked {coll.label} P={comm.size}", flush=True)

report(world)
