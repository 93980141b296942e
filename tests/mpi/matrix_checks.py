"""What the collective matrices (collectives_matrix.py, alltoall_matrix.py) share:
rank- and position-dependent inputs, comparison in float64, expected errors, and
one report of every rank's failures from rank 0 (Abort on any, so the launch fails).

Each check appends to `failures` rather than raising, so one run lists every
mismatch of every rank instead of the first.
"""
import sys

import numpy as np
import torch

from allreduce.buffers import CollectiveError

NUMPY = ["float32", "float64", "int32", "int64", "float16"]
TORCH = ["float32", "float64", "int32", "int64", "float16", "bfloat16"]
failures = []


def make(kind, dtype, r, n, device="cpu"):
    """Rank r's input of n elements: never all-ones, so a misplaced chunk shows."""
    i = np.arange(n)
    if dtype.startswith("int"):
        values = (i * 7 + r * 1000) % 20011 - 10000
    else:
        values = np.sin(0.37 * i + 1.3 * r) * 4
    if kind == "numpy":
        return values.astype(dtype)
    return torch.from_numpy(values.astype(np.float64)).to(getattr(torch, dtype)).to(device)


def f64(x):
    return x.double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)


def compare(label, got, want, tol=0):
    got = f64(got)
    if got.shape != want.shape:
        failures.append(f"{label}: shape {got.shape} != {want.shape}")
        return
    bad = np.abs(got - want) > tol
    if bad.any():
        i = int(np.argmax(bad))
        failures.append(f"{label}: {int(bad.sum())} wrong, first at {i}: {got[i]} != {want[i]}")


def expect_error(label, fn, *words):
    try:
        fn()
    except CollectiveError as e:
        if not all(w in str(e) for w in words):
            failures.append(f"{label}: error {e!r} does not name {words}")
        return
    failures.append(f"{label}: no error raised")


def report(world):
    """Rank 0 prints every rank's failures and aborts the launch on any; else OK P=..."""
    all_failures = world.gather(failures, root=0)
    if world.rank == 0:
        flat = [f"rank {r}: {f}" for r, fs in enumerate(all_failures) for f in fs]
        if flat:
            print("\n".join(flat[:60]))
            print(f"FAILED: {len(flat)} mismatches")
            sys.stdout.flush()
            world.Abort(1)
        print(f"OK P={world.size}")
