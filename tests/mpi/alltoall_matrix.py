"""Tier (b): all-to-all of every algorithm against an independent reference.

    mpiexec -n P python -m mpi4py tests/mpi/alltoall_matrix.py

Every algorithm object (their shared alltoall.py, by the size threshold), both
baselines (MPI_Alltoallv, torch's all_to_all_single), the benchmark's mpi-raw
runner, the ring over torch.distributed, and pairwise exchange and Bruck called explicitly.  Inputs
depend on rank and position, never all ones; every rank makes every rank's
input itself and the reference from those, without communication: output block
j of rank r is rank j's block r.  An all-to-all moves values and adds nothing,
so the comparison is exact (tolerance 0).  Then bad input: a clear error on
every rank, also where one rank alone passes it (TOPOLAB_CHECK=1).
"""
import numpy as np
import torch
from mpi4py import MPI

import allreduce
from allreduce import alltoall
from allreduce.buffers import empty_like, is_tensor
from allreduce.native import MPIRaw
from matrix_checks import NUMPY, TORCH, compare, expect_error, f64, failures, make, report

world = MPI.COMM_WORLD
P, rank = world.size, world.rank
# empty, one element (P-1 empty blocks), fewer than P, not divisible, Bruck's size,
# and one whose blocks (5001 elements) take pairwise exchange at 4-byte dtypes
SIZES = sorted({0, 1, max(P - 1, 0), 7, 1003})
BIG = 20_003


def reference(kind, dtype, n):
    """Rank `rank`'s output: block `rank` of every rank's input, in rank order."""
    bounds = allreduce.shard_bounds(n, P)
    return np.concatenate([f64(make(kind, dtype, j, n))[slice(*bounds[rank])] for j in range(P)])


def check_collective(coll, label, dtypes):
    for kind, names in (("numpy", dtypes[0]), ("torch", dtypes[1])):
        for dtype in names:
            for n in SIZES + ([BIG] if dtype in ("float32", "bfloat16") else []):
                x = make(kind, dtype, rank, n)
                want = reference(kind, dtype, n)
                compare(f"{label} {kind} {dtype} n={n}", coll.alltoall(x), want)
                compare(f"{label} {kind} {dtype} n={n} leaves x", x,
                        f64(make(kind, dtype, rank, n)))
                if n != 7:                    # into a given out: once a dtype is enough
                    continue
                out = empty_like(x, len(want))
                if coll.alltoall(x, out=out) is not out:
                    failures.append(f"{label}: alltoall(x, out) does not return out")
                compare(f"{label} {kind} {dtype} n={n} into out", out, want)


def check_schedules(coll):
    """Pairwise and Bruck called explicitly, with the bytes each sends per alltoall.bytes_sent."""
    t = coll.transport
    for name, fn in (("pairwise", alltoall.pairwise_exchange), ("bruck", alltoall.bruck)):
        for kind, dtype in (("numpy", "float64"), ("numpy", "int32"), ("torch", "bfloat16")):
            for n in SIZES + [4 * P * 25, BIG]:
                x = make(kind, dtype, rank, n)
                want = reference(kind, dtype, n)
                out = empty_like(x, len(want))
                before = t.bytes_sent
                fn(t, x, out, allreduce.shard_bounds(n, P))
                compare(f"{name} P={P} {kind} {dtype} n={n}", out, want)
                if n % P == 0 and P > 1:      # even blocks: the textbook formula is exact
                    nbytes = n * (x.element_size() if is_tensor(x) else x.itemsize)
                    expected = alltoall.bytes_sent(nbytes, P, bruck=name == "bruck")
                    if t.bytes_sent - before != expected:
                        failures.append(f"{name} P={P} n={n}: sent {t.bytes_sent - before} "
                                        f"bytes, the formula says {expected}")


def check_bad_input(coll):
    name = coll.name
    x = np.arange(4 * P, dtype=np.float32)
    fits = np.empty(4 * P, dtype=np.float32)
    ro = np.empty(4 * P, dtype=np.float32)
    ro.flags.writeable = False
    expect_error(f"{name} strided x", lambda: coll.alltoall(x[::2]), "not C-contiguous")
    expect_error(f"{name} strided out", lambda: coll.alltoall(x, np.empty(8 * P, np.float32)[::2]),
                 "out", "not C-contiguous")
    expect_error(f"{name} out dtype", lambda: coll.alltoall(x, fits.astype(np.float64)),
                 "out is float64, x is float32")
    expect_error(f"{name} out size", lambda: coll.alltoall(x, fits[1:]),
                 f"out has {4 * P - 1} elements", f"receives {4 * P}")
    expect_error(f"{name} out read-only", lambda: coll.alltoall(x, ro), "read-only")
    expect_error(f"{name} out kind", lambda: coll.alltoall(x, torch.empty(4 * P)), "same kind")
    expect_error(f"{name} in place", lambda: coll.alltoall(x, x), "shares memory with x")
    expect_error(f"{name} tensor strided", lambda: coll.alltoall(torch.zeros(4, 4).t()),
                 "not contiguous")
    expect_error(f"{name} dtype", lambda: coll.alltoall(np.zeros(3, np.complex64)),
                 "unsupported dtype")
    if P > 1:   # one rank's bad out: every rank raises, naming it
        out = fits[1:] if rank == P - 1 else fits
        expect_error(f"{name} bad out on one rank", lambda: coll.alltoall(x, out),
                     f"invalid input on rank(s) {P - 1}")


ALL = (NUMPY, TORCH)
QUICK = (["float32", "int64"], ["bfloat16"])
for algo, options, dtypes in (
        ("ring", {}, ALL), ("tree", {}, QUICK), ("halving_doubling", {}, QUICK),
        ("hierarchical", {"ranks_per_node": 2}, QUICK), ("auto", {}, QUICK),
        ("mpi", {}, ALL), ("torch", {}, ALL)):
    coll = allreduce.create(algo, **options)
    check_collective(coll, f"{algo} P={P}", dtypes)
    if algo == "ring":
        check_schedules(coll)
    if algo in ("ring", "mpi", "torch"):
        check_bad_input(coll)
check_collective(allreduce.create("ring", transport="torch"), f"ring@torch P={P}", QUICK)
for n in SIZES:                     # the benchmark's floor: MPI_Alltoallv with no topolab layer
    x = make("numpy", "float32", rank, n)
    compare(f"mpi-raw P={P} n={n}", MPIRaw(world).runner("alltoall", n)(x),
            reference("numpy", "float32", n))

report(world)
