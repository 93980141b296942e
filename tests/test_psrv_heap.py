"""psrv/heap.py: glibc malloc keeps freed 1 MiB frames instead of faulting in fresh pages.

Tier (a): tune() is applied (the page faults of a frame-like allocation pattern
fall, measured in a fresh interpreter so no earlier test's tuning counts), it is
what a Server and a Client call when they start, and it is a no-op, not an
error, where glibc's mallopt is absent or refuses.  trim() gives back what another
thread's frames held, in one arena (test_psrv_flood.py shows the shard's case, where
without one_arena() libzmq's I/O thread kept 60 MiB after the trim).
"""
import platform
import subprocess
import sys

import pytest

from psrv import heap
from psrv.server import Server

# 40 rounds of "receive a 16 MiB message as 16 frames of 1 MiB, then free them all":
# with glibc's defaults the freed top of the heap is trimmed and the next round faults
# its pages in again; tuned, they are reused.  Prints the minor faults of the rounds.
FRAMES = """
import resource, sys
import numpy as np
from psrv import heap
if sys.argv[1] == "tuned":
    assert heap.tune()
def round_of_frames():
    frames = [np.empty(1 << 20, np.uint8) for _ in range(16)]
    for f in frames:
        f.fill(1)                          # touch every page, as a received frame does
round_of_frames()                          # the first round faults in any case
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    round_of_frames()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


# In one arena, a thread allocates 64 frames of 1 MiB (as libzmq's I/O thread receives
# them), the main thread frees them (as the shard drops a refused message), then trim():
# prints the resident MiB above the start that stay.
THREAD_FRAMES = """
import sys, threading
import numpy as np
from psrv import heap
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
assert heap.tune() and heap.one_arena()
frames, start = [], rss_mib()
def receive():
    for _ in range(64):
        frames.append(np.ones(1 << 20, np.uint8))
thread = threading.Thread(target=receive)
thread.start()
thread.join()
frames.clear()
heap.trim()
print(rss_mib() - start)
"""


def faults(mode):
    out = subprocess.run([sys.executable, "-c", FRAMES, mode], capture_output=True, text=True,
                         timeout=60, check=True)
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_tuned_heap_reuses_freed_frames():
    default, tuned = faults("default"), faults("tuned")
    # 40 rounds x 16 MiB = 160k pages of 4 KiB: the default faults in most of them
    assert default > 40 * 1000, default
    assert tuned < default / 20, (tuned, default)


def test_server_and_client_start_tune_the_heap(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "tune", lambda: calls.append(1) or True)
    server = Server("tcp://127.0.0.1:0", 0, 1, worker_timeout=1.0, linger_ms=0)
    server.listener.close()
    assert calls == [1]
    import psrv
    psrv.Client([server.endpoint], 0, 1, timeout=0.2).close()     # nobody answers its BYE
    assert calls == [1, 1]


@pytest.mark.parametrize("mallopt", [None, lambda param, value: 0],
                         ids=["no glibc", "mallopt refuses"])
def test_tune_is_a_no_op_where_glibc_cannot(monkeypatch, mallopt):
    monkeypatch.setattr(heap, "_mallopt", lambda: mallopt)
    monkeypatch.setattr(heap, "_tuned", None)
    assert heap.tune() is False
    assert heap.tune() is False                # asked again: the same answer, not a retry


def test_tune_sets_both_thresholds_once(monkeypatch):
    seen = []
    monkeypatch.setattr(heap, "_mallopt", lambda: lambda param, value: seen.append((param, value)) or 1)
    monkeypatch.setattr(heap, "_tuned", None)
    assert heap.tune() and heap.tune()
    assert seen == [(heap.M_MMAP_THRESHOLD, 4 << 20), (heap.M_TRIM_THRESHOLD, 256 << 20)]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_gives_back_another_threads_frames_in_one_arena():
    out = subprocess.run([sys.executable, "-c", THREAD_FRAMES], capture_output=True,
                         text=True, timeout=60, check=True)
    assert float(out.stdout) < 8, f"trim left {float(out.stdout):.0f} MiB of 64 MiB of frames"
