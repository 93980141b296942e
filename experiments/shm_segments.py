"""What an MPI job that ends early leaves in /dev/shm, and removing it afterwards.

    before = shm_segments.snapshot()
    ... run an mpiexec job ...
    shm_segments.remove_left(before)      # the segments it left that nobody maps

MPICH puts the ranks of a host in touch through a shared-memory segment, a file
in /dev/shm (`mpich_shm_*`), which it removes in MPI_Finalize.  A job that
aborts (MPI_Abort: `python -m mpi4py` calls it on an uncaught exception, and a
lab's check on a wrong ring) or whose ranks are killed (a sweep's time limit)
never gets there, and the file stays, holding 1-4 MiB of memory each, until the
machine restarts.  A day of failing test runs left 1,629 of them here (3.6 GiB).

So whatever launches jobs that may end early (a sweep's points, the labs' check,
the test suite) removes, after each job, the segments that appeared meanwhile,
belong to this user and are mapped by no live process.  A job still running
maps its own, so it keeps it; a segment another user's job left is not ours.
"""
import os
import time
from pathlib import Path

SHM = Path("/dev/shm")
PATTERN = "mpich_shm_*"


def snapshot():
    """The names of this user's MPICH segments now."""
    if not SHM.is_dir():
        return set()
    names = set()
    for path in SHM.glob(PATTERN):
        try:
            if path.stat().st_uid == os.getuid():
                names.add(path.name)
        except FileNotFoundError:       # removed by its job meanwhile
            pass
    return names


def mapped():
    """The /dev/shm names that some live process has mapped (the ones /proc lets us read)."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:                 # a process that ended meanwhile, or not ours to read
            continue
        names.update(line.split("/dev/shm/", 1)[1].split(" ")[0]
                     for line in text.splitlines() if "/dev/shm/" in line)
    return names


def remove_left(before, settle_s=0.0):
    """Remove this user's segments that are not in `before` (a snapshot taken before the
    job) and that no live process maps; returns how many went.  settle_s: how long to
    keep looking while some new segment is still mapped, for a job whose ranks are
    still being torn down (an aborted job's, killed by its launcher) when it returns."""
    deadline = time.monotonic() + settle_s
    removed = 0
    while True:
        left = snapshot() - set(before)
        in_use = mapped() if left else set()
        for name in left - in_use:
            try:
                (SHM / name).unlink()
                removed += 1
            except FileNotFoundError:
                pass
        if not left & in_use or time.monotonic() >= deadline:
            return removed
        time.sleep(0.05)
