"""What the package raises on purpose, one class per layer, under one base.

    AllreduceError          catch this to catch everything below
      TransportError        the point-to-point layer (transport.py, torch_transport.py):
        TransportTimeout      a peer that never came, a torch group not all ranks made
      CollectiveError       the collective layer: a bad argument, ranks that disagree,
        CollectiveTimeout     or a transport error met during a collective, named again
                              with the algorithm and the collective that met it

The layers stay apart: a transport knows nothing of collectives, so it raises its
own class, and `Collective` (collective.py) turns what it meets into the
collective layer's, naming the algorithm and the collective ("ring allreduce:
rank 0: wait timed out after 3 s waiting for rank 1").  The timeouts are also
TimeoutErrors, for whoever catches those.
"""


class AllreduceError(RuntimeError):
    """Anything this package raises on purpose."""


class TransportError(AllreduceError):
    """A transport was used wrongly or could not move a message."""


class TransportTimeout(TransportError, TimeoutError):
    """A wait ran past the transport's timeout."""

    def __init__(self, rank, peers, timeout, what="wait"):
        self.rank, self.peers, self.timeout = rank, peers, timeout
        names = ", ".join(f"rank {p}" for p in peers) or "?"
        super().__init__(f"rank {rank}: {what} timed out after {timeout:g} s waiting for {names}")


class CollectiveError(AllreduceError):
    """A collective was called wrongly, ranks disagree about the call, or its
    transport failed under it."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective's transport timed out."""
