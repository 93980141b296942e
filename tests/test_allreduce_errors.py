"""Tier (a): the seams of allreduce: each layer raises its own error, the collective
layer names a transport's again, and the factory builds by name without a process."""
import re

import numpy as np
import pytest

import allreduce
from allreduce.errors import (AllreduceError, CollectiveError, CollectiveTimeout,
                              TransportError, TransportTimeout)
from allreduce.transport import Transport


class BrokenTransport(Transport):
    """Rank 0 of 2, whose every message and barrier fails with `error`."""
    rank, size = 0, 2

    def __init__(self, error):
        super().__init__(timeout=1.0)
        self.error = error

    def isend(self, buf, peer, tag=0):
        raise self.error

    irecv = isend

    def barrier(self):
        raise self.error

    def world_rank(self, rank):
        return rank


def test_the_layers_have_their_own_errors_under_one_base():
    assert issubclass(TransportTimeout, TransportError) and issubclass(TransportTimeout,
                                                                       TimeoutError)
    assert issubclass(CollectiveTimeout, CollectiveError) and issubclass(CollectiveTimeout,
                                                                         TimeoutError)
    assert not issubclass(TransportError, CollectiveError)
    assert not issubclass(CollectiveError, TransportError)
    for cls in (TransportError, CollectiveError):
        assert issubclass(cls, AllreduceError) and getattr(allreduce, cls.__name__) is cls


@pytest.mark.timeout(30)
@pytest.mark.parametrize("error, expected", [
    (TransportTimeout(0, [1], 1.0), CollectiveTimeout),
    (TransportError("rank 0: torch.distributed failed talking to rank 1: reset"),
     CollectiveError)])
@pytest.mark.parametrize("algo", allreduce.TEXTBOOK)
def test_a_transport_error_comes_back_naming_the_algorithm_and_collective(algo, error,
                                                                         expected):
    coll = allreduce.make(algo, BrokenTransport(error))
    calls = {"allreduce": lambda: coll.allreduce(np.arange(8, dtype=np.float32)),
             "reduce_scatter": lambda: coll.reduce_scatter(np.arange(8, dtype=np.float32)),
             "allgather": lambda: coll.allgather(np.arange(4, dtype=np.float32), 8),
             "broadcast": lambda: coll.broadcast(np.arange(8, dtype=np.float32)),
             "barrier": coll.barrier}
    for collective, call in calls.items():
        with pytest.raises(expected, match=f"^{algo} {collective}: {re.escape(str(error))}$") \
                as caught:
            call()
        assert type(caught.value) is expected


def test_the_factory_names_what_is_wrong():
    broken = BrokenTransport(TransportError("unused"))
    with pytest.raises(TransportError, match="unknown transport 'tcp'"):
        allreduce.make_transport("tcp")
    with pytest.raises(CollectiveError, match=r"ring: bad option \(.*segment_size"):
        allreduce.make("ring", broken, segment_size=1)
    with pytest.raises(CollectiveError, match="hierarchical: inner='shm' is not one of "
                                              "ring, tree, halving_doubling, mpi"):
        allreduce.make("hierarchical", broken, inner="shm")
    with pytest.raises(CollectiveError, match="the 'mpi' baseline needs an MPI transport"):
        allreduce.make("mpi", broken)
    assert type(allreduce.make("tree", broken)).__name__ == "Tree"
