"""CUDA IPC between ranks that share a GPU (allreduce/cuda_ipc.py), where it can be
checked without one: which ranks pair up, when the factory picks the transport,
and the protocol itself (headers, slots, acks, the staged path to a rank on
another GPU) over MPI with a stand-in for device memory (tests/mpi/cuda_ipc_protocol.py).
The real thing, CUDA tensors at 2 and 3 ranks on one GPU, is in tests/gpu/test_nccl.py.
"""
import pytest
import torch

import allreduce
from allreduce.cuda_ipc import peers_sharing, unable
from allreduce.factory import device_transport
from allreduce.staging import HostStagedTransport
from conftest import check_ok, mpirun


def test_ranks_pair_up_by_their_gpus_identity():
    a, b = b"a" * 32, b"b" * 32
    assert peers_sharing([a, b, a, a], 0) == [2, 3]
    assert peers_sharing([a, b, a, a], 1) == []
    assert peers_sharing([unable(0), unable(1)], 0) == []      # no runtime: never paired


class OneRank:
    """A transport of one rank that takes no CUDA tensors (as the MPI one without CUDA-awareness)."""
    takes_cuda, rank, size = False, 0, 1


def test_the_factory_keeps_ipc_to_gpus():
    assert device_transport(OneRank(), None) is None
    assert device_transport(OneRank(), torch.device("cpu")) is None
    assert device_transport(OneRank(), torch.device("cuda")) is None    # not MPI


def test_a_pipelines_transport_off_a_gpu_is_staged_as_before():
    from allreduce.transport import Transport

    class HostOnly(Transport):
        rank, size = 0, 1
    staged = allreduce.host_staged(HostOnly())
    assert isinstance(staged, HostStagedTransport)


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_the_protocol_moves_every_message_through_the_peers_slots(tmp_path):
    """Also: where one rank cannot map its peer's memory, every rank stages, and that
    rank says why in one line."""
    result = check_ok(mpirun(3, ["tests/mpi/cuda_ipc_protocol.py", tmp_path], timeout=140))
    assert result.stdout.count("OK rank") == 3
    refused = [line for line in result.stderr.splitlines() if "CUDA IPC refused" in line]
    assert refused == ["topolab: rank 1: CUDA IPC refused (mapping rank 0's memory: "
                       "cudaIpcOpenMemHandle failed: CUDA error 201 (stand-in)); ranks that "
                       "share a GPU stage through host memory"], refused
