"""The control waits of a run, each bounded by --timeout and naming who never came.

    workers = Bounded(ctx.workers, cfg.timeout)   # collective: every worker, once
    workers.allgather(obj)      # the records' flush, the run id, the resume's check
    workers.barrier()           # the loop's meeting before a checkpoint, save's end

The gradients' collectives and the pipeline's messages already wait at most
--timeout (allreduce/transport.py).  The control messages did not: mpi4py's pickled
allgather and a polled Ibarrier wait for ever, so a rank that stopped (SIGSTOP, a
debugger, a swapped-out host) between two steps' collectives left every other rank
spinning in the metrics flush.  Here an allgather is point-to-point on a duplicate
of the communicator, P - 1 tiny sends and receives a rank (the records of a step
are a few hundred bytes; Bruck's log P rounds would save messages, not seconds, at
the sizes a control message has), and so each rank knows whose message is missing:

    rank r:  isend(obj) to every peer          (eager: done at once for small ones)
             poll improbe(peer) until every peer's message came, or the deadline
             wait for its own sends, against the same deadline

Messages of one source on one communicator and tag do not overtake each other
(MPI's ordering rule), so round k's message is matched before round k + 1's.  The
loop sleeps between polls, as MPIControl.barrier does: Python's signal handlers run
(stopping.py needs them), and a waiting rank leaves the cores to the others.  A
barrier is an allgather of nothing.  On the deadline a WaitTimeout (a TimeoutError)
names the waiting rank, what it waited in, and the silent ranks;
strategies.train turns it into one line and exit 1 on that rank.

A rank that ends with an error (its own exception, or a wait past --timeout) then
agrees the end with the others (agree_to_end: the same exchange, on a tag of its
own): when every rank says it ends too, none will wait again and MPI is finalized
on every rank (exits.py); when one stays silent, the others abort.

A trade-off: a wait cannot tell a stopped rank from a slow one.  Under ASP a
worker meets the others only at checkpoints and at the end, and waits there for
the slowest one's lag, which --timeout must then cover (a straggler of 20 ms a
step, 60 steps: 1.2 s; the default timeout is 60 s).
"""
import time

TAG = 11                       # on the wrapper's own communicator, so nothing else matches
END_TAG = 12                   # the notices of ranks that end with an error (agree_to_end)


class WaitTimeout(TimeoutError):
    def __init__(self, rank, silent, timeout, what):
        self.rank, self.silent, self.timeout = rank, silent, timeout
        names = ", ".join(f"rank {p}" for p in silent)
        super().__init__(f"rank {rank}: {what} timed out after {timeout:g} s waiting for "
                         f"{names} (stopped, hung or gone; --timeout bounds every wait)")


class Bounded:
    """MPIControl's allgather and barrier, each bounded by `timeout` seconds.

    control: an MPIControl (its `comm`, duplicated here: collective over it)."""

    def __init__(self, control, timeout):
        self.inner, self.comm = control, control.comm     # stopping.py duplicates `comm`
        self.rank, self.size = control.rank, control.size
        self.timeout = timeout
        self.p2p = control.comm.Dup()
        self.peers = [p for p in range(self.size) if p != self.rank]

    def allgather(self, obj, what="control allgather"):
        return self._exchange(obj, what, TAG, self.timeout)

    def agree_to_end(self, why, within):
        """This rank ends with an error (`why`, a line): tell every peer so, and hear
        each of them say the same within `within` seconds -> {rank: its why}.  Then
        every rank is on its way out and none will wait for another again: they may
        finalize MPI together (exits.py).  WaitTimeout names the ranks that said
        nothing: stopped, hung, or still inside an unbounded wait.  The notices have a
        tag of their own, so no control message of a step matches them."""
        return dict(enumerate(self._exchange(why, "the agreement to end", END_TAG, within)))

    def _exchange(self, obj, what, tag, timeout):
        out = [None] * self.size
        out[self.rank] = obj
        sends = [self.p2p.isend(obj, dest=p, tag=tag) for p in self.peers]
        missing = list(self.peers)
        deadline = time.monotonic() + timeout
        pause = 0.0001
        while missing:
            for p in list(missing):
                message = self.p2p.improbe(source=p, tag=tag)
                if message is not None:
                    out[p] = message.recv()
                    missing.remove(p)
            if not missing:
                break
            if time.monotonic() > deadline:
                raise WaitTimeout(self.rank, missing, timeout, what)
            time.sleep(pause)
            pause = min(2 * pause, 0.002)
        while sends and not all(s.Test() for s in sends):
            if time.monotonic() > deadline:
                silent = [p for p, s in zip(self.peers, sends) if not s.Test()]
                raise WaitTimeout(self.rank, silent, timeout, what)
            time.sleep(0.0005)
        return out

    def barrier(self, what="barrier"):
        self.allgather(None, what)

    def free(self):
        self.p2p.Free()


def bounded(control, timeout):
    """`control` with bounded waits where it is MPI's; as it is otherwise (torchrun's
    object collectives have the process group's own timeout)."""
    return Bounded(control, timeout) if hasattr(control, "comm") else control


def allgather(control, obj, what):
    """control.allgather(obj), naming the wait `what` where it is bounded."""
    return control.allgather(obj, what) if isinstance(control, Bounded) else \
        control.allgather(obj)


def barrier(control, what):
    """control.barrier(), naming the wait `what` where it is bounded."""
    return control.barrier(what) if isinstance(control, Bounded) else control.barrier()
