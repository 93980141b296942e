"""Keep the C heap's freed pages: glibc malloc tuned for a stream of 1 MiB frames.

Every payload frame psrv moves is ~1 MiB (protocol.CHUNK_BYTES), and libzmq
allocates each received frame with malloc and frees it once Python drops it.
glibc's malloc (ptmalloc, after Doug Lea, 1996, "A Memory Allocator"; its knobs
in mallopt(3)) by default treats a large block as rare and long-lived:

    default                          what it does to a 64 MiB push+pull (64 frames each way)
    M_MMAP_THRESHOLD  128 KiB, moved  a block above it is mmap'ed and munmap'ed when freed;
                      up to 32 MiB   the kernel hands out zeroed pages that fault on first
                      by each free   touch (4 KiB each: 256 faults per 1 MiB frame)
    M_TRIM_THRESHOLD  2 x the mmap   free space above it at the heap's top is given back
                      threshold      (brk/madvise), so the next frames fault it in again

Measured with psrv.bench on loopback TCP, 1 worker x 1 server, 64 MiB: 7,700-9,300
minor page faults per round (worker and server together) with the defaults, 16
after `tune()`, and the CPU time of a round fell from 82-95 ms to 66-73 ms
(docs/measurements/psrv/README.md, "The heap tuning").  A raw pyzmq echo faults too, until
glibc's moving threshold happens to settle above its frames.

`tune()` sets both, for the whole process:

    M_MMAP_THRESHOLD = 4 MiB     frames (1 MiB) and messages' bookkeeping come from the
                                 heap and are reused; a parameter-sized array (larger)
                                 is still mmap'ed, and its memory goes back when freed
    M_TRIM_THRESHOLD = 256 MiB   a heap with up to 256 MiB free at its top keeps it: the
                                 frames of the next message land in warm pages

The trade-off: a process that once held many frames in flight keeps up to
256 MiB of heap it no longer uses (per malloc arena).  That is what lets the
next step reuse it; the operating system sees it as resident memory.

Only glibc has mallopt with these parameters (musl, macOS, Windows do not):
there `tune()` does nothing and returns False.  It is called when a Client or a
Server starts, and is idempotent.

`trim()` is the way back: malloc_trim(3) returns the free pages of the heap to
the kernel, whatever the threshold says.  A shard calls it after a flood it refused
or after workers left (server.py); it costs a few milliseconds, and the next step
faults its pages in again, which is why an ordinary step never calls it.  One catch:
libzmq's I/O thread allocates every received frame, and glibc gives a new thread an
arena of its own, which malloc_trim does not always empty (it shrinks the top of the
main arena only).  Measured: 9 refused messages of 32 MiB left a shard 57-63 MiB
above its baseline after the trim, in the 64 MiB heap of the I/O thread's arena
(/proc/PID/smaps).  So a shard calls `one_arena()` before its ZeroMQ context starts
its I/O thread: every thread then allocates from the main arena (M_ARENA_MAX = 1),
and the same trim left -2 MiB.  The cost is a lock shared by two threads that
already share it, since the main thread frees the I/O thread's frames; psrv.bench
(64 MiB, 1 worker, 1 server) showed no difference beyond its noise (55-62 ms a
round, 95 ms of CPU, 34 page faults either way).
"""
import ctypes
import ctypes.util

# mallopt(3) parameter numbers, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 4 << 20
TRIM_THRESHOLD_BYTES = 256 << 20

_tuned = None          # None: not tried yet; then what tune() returned


def _glibc():
    """The C library if it is glibc, else None (musl has a mallopt that ignores these)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    return libc


def _mallopt():
    """glibc's mallopt, or None where this C library has none (or is not glibc)."""
    libc = _glibc()
    if libc is None:
        return None
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def one_arena():
    """Every thread started from now on allocates from the main arena (a process that has
    already given a thread an arena of its own keeps it).  False where there is no glibc."""
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_ARENA_MAX, 1) == 1


def trim():
    """Give every arena's free pages back to the kernel now.  True if glibc released
    some, False if there was nothing to release or no glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc.malloc_trim(0) == 1


def tune():
    """Set the two thresholds, once per process.  True when glibc took both, False where
    there is no glibc (nothing changed)."""
    global _tuned
    if _tuned is None:
        mallopt = _mallopt()
        _tuned = mallopt is not None and all(
            mallopt(param, value) == 1          # mallopt returns 1 on success, 0 on error
            for param, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                                 (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))
    return _tuned
