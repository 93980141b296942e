"""The communication thread: gradient collectives run beside backward, in one order.

Backward makes gradients from the last layer to the first.  A collective started
as soon as a group of them is complete (a bucket of buckets.py, whose collective
zero.py chooses) overlaps with the backward of the layers before it; only what is still
running when backward ends is exposed (Li et al., "PyTorch Distributed", VLDB
2020, section 3.2.3).  This file is that thread, once, for the bucket engine:

    thread = CommThread()
    thread.submit(reduce_bucket_0)     # from a gradient hook, in the main thread
    thread.submit(reduce_bucket_1)
    thread.flush()                     # after backward: every submitted call is done;
                                       # re-raises the first error a call raised
    thread.close()

Calls run one at a time, in the order submitted.  Every rank of a communicator
must issue the same collectives in the same order, so the order of `submit` is
the contract: the buckets are submitted in index order, the same on every rank.

The thread's collectives must not share a communicator with collectives the
main thread runs meanwhile (ZeRO-3 gathers parameters in backward, tensor
parallelism all-reduces activations): two threads' messages on one communicator
and tag could match each other's receives.  Where the main thread talks
meanwhile, the thread gets a collective of its own, over a duplicate of the
communicator (zero.py's thread_coll).

On a GPU the thread has a CUDA stream of its own.  A gradient hook runs when
backward has *queued* the kernels that make the gradient, not when they have
run, so it records an event there and submits the call after it:

    thread.submit(reduce_bucket_0, after=event_0)

    compute stream  ==[bucket 0's kernels]==(event_0)==[bucket 1's kernels]==...==>
    thread's stream                     wait(event_0) [bucket 0: staging copy or NCCL]
    the thread (CPU)  submit returns at once; runs the call with its stream current
    flush's caller                                 its stream waits(thread's stream) ==>

The stream, not the CPU, waits for the event: the call's device work (the host
staging's copy down, allreduce/staging.py, which orders itself after the
current stream; an NCCL kernel, which torch orders the same way) follows
exactly that bucket's kernels, while the next layers' backward runs beside it.
flush makes the caller's stream wait for the thread's, so the optimizer's step
queued after it reads the reduced gradients: no host wait on either side.
Calls submitted without an event run as before (the thread's default stream),
after the work already queued on its own stream.  On a CPU nothing of this exists.

mpi4py initialises MPI with MPI_THREAD_MULTIPLE, so the thread may call MPI while
the main thread computes.  After an error the calls still queued are skipped (the
collective that failed left its peers out of step): flush raises it on the main
thread, where the loop aborts the run.
"""
import os
import queue
import sys
import threading

import torch

from allreduce.staging import CudaCopies

# The thread runs Python (the ring's loops, polling MPI) while backward runs; every
# gradient hook needs the GIL back, and by default may wait up to 5 ms for it.  A
# 0.2 ms switch interval bounds that wait.  TOPOLAB_SWITCH_S overrides it for experiments.
SWITCH_INTERVAL_S = float(os.environ.get("TOPOLAB_SWITCH_S", "0.0002"))

_FLUSH = object()
_STOP = object()


class CommThread:
    """streams: the CUDA calls of the thread's stream (staging.CudaCopies' interface);
    default: made for the GPU of the first event submitted."""

    def __init__(self, name="grad-comm", streams=None):
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.error = None
        self.streams = streams
        self._calls = queue.Queue()
        self._flushed = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call, after=None):
        """Run call() on the thread after every call submitted before it.  after: a
        CUDA event recorded where call's inputs are complete; call then runs with the
        thread's stream current, and that stream waits for the event, not the CPU."""
        if after is not None and self.streams is None:
            # made here, on the thread that recorded the event: its current GPU
            self.streams = CudaCopies(event_device(after))
        self._calls.put((call, after))

    def flush(self):
        """Wait until every submitted call has run; re-raise the first error.  The
        caller's stream then waits for the thread's (on the GPU, not the CPU)."""
        self._calls.put((_FLUSH, None))
        self._flushed.get()
        if self.streams is not None:
            s = self.streams
            s.wait(s.current(), s.record(s.side))
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _run(self):
        while True:
            call, after = self._calls.get()
            if call is _STOP:
                return
            if call is _FLUSH:
                self._flushed.put(True)
            elif self.error is None:
                try:
                    self._call(call, after)
                except BaseException as e:     # re-raised on the main thread by flush
                    self.error = e

    def _call(self, call, after):
        s = self.streams
        if after is None:
            if s is not None:                  # after what the thread's stream has queued
                s.wait(s.current(), s.record(s.side))
            call()
            return
        s.wait(s.side, after)
        with s.using(s.side):
            call()

    def close(self):
        self._calls.put((_STOP, None))
        self._thread.join(timeout=5)


def event_device(event):
    """The GPU a CUDA event belongs to: its own where torch says, else the current one."""
    device = getattr(event, "device", None)
    return device if device is not None else torch.device("cuda", torch.cuda.current_device())
