"""What a measurement of psrv needs besides the harness: results from worker processes, CPU time.

psrv's workers are separate processes (multiprocessing, spawn), not one MPI job,
so each times itself with allreduce.harness.interleaved and a barrier of its own,
and puts what it measured on a queue; the driver takes them off with `collect`,
which fails as soon as a worker dies instead of waiting out its timeout.  Used by
psrv.bench (the benchmark, a command line) and experiments.calibrate (the cost
model's psrv constants); neither imports the other.
"""
import os
import queue
import time


def collect(results, count, procs, timeout=600.0):
    """`count` items from a multiprocessing queue, or a readable error as soon as
    one of `procs` has died (rather than waiting out the timeout)."""
    items, deadline = [], time.monotonic() + timeout
    while len(items) < count:
        try:
            items.append(results.get(timeout=1.0))
        except queue.Empty:
            dead = [f"{p.name} (exit code {p.exitcode})" for p in procs
                    if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"benchmark process died: {', '.join(dead)}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(items)} of {count} results after {timeout:g} s")
    return items


# The name libzmq gives its I/O threads (ZMQbg/IO/0, ...), which move every byte
# between the sockets and the kernel.
ZMQ_IO_THREADS = "ZMQbg/IO/"


def cpu_seconds(pid, named=None):
    """CPU seconds a process has run so far, all its threads, or only those whose
    name starts with `named` (Linux /proc).  schedstat counts nanoseconds; stat's
    utime + stime (fields 14, 15) only clock ticks of 10 ms, too coarse for an
    iteration of a few ms."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            if named is not None:
                with open(f"/proc/{pid}/task/{task}/comm") as f:
                    if not f.read().startswith(named):
                        continue
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:       # a thread that ended meanwhile
            pass
    return total / 1e9


def minor_faults(pid):
    """Minor page faults a process has taken so far, all its threads (Linux /proc:
    field 10 of stat).  A fault is a page the kernel had to map in, zeroed, on first
    touch: many per round mean the heap gives memory back and takes it again (heap.py)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])
