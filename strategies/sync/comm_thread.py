"""The communication thread: gradient collectives run beside backward, in one order.

Backward makes gradients from the last layer to the first.  A collective started
as soon as a group of them is complete (a bucket, buckets.py; a ZeRO layer,
zero.py) overlaps with the backward of the layers before it; only what is still
running when backward ends is exposed (Li et al., "PyTorch Distributed", VLDB
2020, section 3.2.3).  This file is that thread, once, for both users:

    thread = CommThread()
    thread.submit(reduce_bucket_0)     # from a gradient hook, in the main thread
    thread.submit(reduce_bucket_1)
    thread.flush()                     # after backward: every submitted call is done;
                                       # re-raises the first error a call raised
    thread.close()

Calls run one at a time, in the order submitted.  Every rank of a communicator
must issue the same collectives in the same order, so the order of `submit` is
the contract: the callers submit in an order that is the same on every rank
(buckets in index order, ZeRO layers in the order the schedule finishes them).

The thread's collectives must not share a communicator with collectives the
main thread runs meanwhile (ZeRO-3 gathers parameters in backward, tensor
parallelism all-reduces activations): two threads' messages on one communicator
and tag could match each other's receives.  Its users give it a collective of
its own, over a duplicate of the communicator (zero.py).

mpi4py initialises MPI with MPI_THREAD_MULTIPLE, so the thread may call MPI while
the main thread computes.  After an error the calls still queued are skipped (the
collective that failed left its peers out of step): flush raises it on the main
thread, where the loop aborts the run.
"""
import os
import queue
import sys
import threading

# The thread runs Python (the ring's loops, polling MPI) while backward runs; every
# gradient hook needs the GIL back, and by default may wait up to 5 ms for it.  A
# 0.2 ms switch interval bounds that wait.  TOPOLAB_SWITCH_S overrides it for experiments.
SWITCH_INTERVAL_S = float(os.environ.get("TOPOLAB_SWITCH_S", "0.0002"))

_FLUSH = object()
_STOP = object()


class CommThread:
    def __init__(self, name="grad-comm"):
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.error = None
        self._calls = queue.Queue()
        self._flushed = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call):
        """Run call() on the thread after every call submitted before it."""
        self._calls.put(call)

    def flush(self):
        """Wait until every submitted call has run; re-raise the first error."""
        self._calls.put(_FLUSH)
        self._flushed.get()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _run(self):
        while True:
            call = self._calls.get()
            if call is _STOP:
                return
            if call is _FLUSH:
                self._flushed.put(True)
            elif self.error is None:
                try:
                    call()
                except BaseException as e:     # re-raised on the main thread by flush
                    self.error = e

    def close(self):
        self._calls.put(_STOP)
        self._thread.join(timeout=5)
