"""experiments.shm_segments: after a job, the MPICH segments it left and nobody maps
are removed; one a live process maps, or one that was there before, stays."""
import mmap
import os
from pathlib import Path

import pytest

from experiments import shm_segments

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm here")


def segment(name, nbytes=4096):
    path = shm_segments.SHM / f"mpich_shm_topolab_test_{os.getpid()}_{name}"
    path.write_bytes(b"\0" * nbytes)
    return path


def test_what_a_job_left_unmapped_goes_and_the_rest_stays():
    older = segment("older")
    try:
        before = shm_segments.snapshot()
        assert older.name in before
        left, in_use = segment("left"), segment("in_use")
        with open(in_use, "r+b") as f, mmap.mmap(f.fileno(), 4096) as view:
            assert in_use.name in shm_segments.mapped()
            assert shm_segments.remove_left(before) == 1
            assert not left.exists()
            assert in_use.exists() and older.exists()
            view[0] = 1                         # still usable by its process
        assert shm_segments.remove_left(before) == 1   # unmapped now: it goes too
        assert not in_use.exists() and older.exists()
    finally:
        for p in shm_segments.SHM.glob(f"mpich_shm_topolab_test_{os.getpid()}_*"):
            p.unlink()


def test_a_segment_let_go_while_the_job_is_torn_down_goes_too():
    """An aborted job's ranks may still be exiting when its launcher returns:
    remove_left(settle_s) looks again until they let their segment go."""
    import threading
    before = shm_segments.snapshot()
    late = segment("late")
    try:
        f = open(late, "r+b")
        view = mmap.mmap(f.fileno(), 4096)

        def let_go():
            view.close()
            f.close()
        threading.Timer(0.3, let_go).start()
        assert shm_segments.remove_left(before, settle_s=5.0) == 1
        assert not late.exists()
    finally:
        for p in shm_segments.SHM.glob(f"mpich_shm_topolab_test_{os.getpid()}_*"):
            p.unlink()
