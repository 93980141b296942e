"""When a waiting rank may sleep between polls, apart from the transport that polls.

Without torch (allreduce/transport.py's buffers import it), so the lab's own
transport (experiments/labs/check_ring.py) asks the same question the same way.
"""
import os


def may_nap():
    """Whether a long wait may sleep between polls.  Only where this host runs
    more ranks than it has cores: then the peer we wait for may need our core,
    and yielding alone does not hand it over soon enough (small messages at
    P = 3, 4 on 2 cores: 8 ms without naps, 0.4 ms with them).  Elsewhere a nap
    stalls the transfer itself: MPICH without its single-copy path (CMA) moves a
    large message through shared memory only while both ranks poll, and a 1 MiB
    exchange took 24 ms with naps against 0.6 ms without.  MPICH and Open MPI
    tell each rank how many ranks share its host."""
    forced = os.environ.get("TOPOLAB_NAP", "")
    if forced in ("0", "1"):
        return forced == "1"
    local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    return bool(local) and int(local) > (os.cpu_count() or 1)
