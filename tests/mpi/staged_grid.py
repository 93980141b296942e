"""The grid's runs with every tensor staged through host memory, as a GPU's would be.

    mpiexec -n 2 python -m mpi4py tests/mpi/staged_grid.py OUT RUNS

RUNS: a JSON list of [name, [strategies.train flags]].  Each run trains twice in
this launch: as it is (OUT/NAME-plain.*), then with the workers' one decision,
gradient_sync.for_device, answering as on a GPU whose MPI moves host memory only
(OUT/NAME-staged.*): every collective of the grid and of the experts wrapped in
allreduce's HostStaged, the pipeline's transport in HostStagedTransport.  Their
`needs_host` says yes to every tensor, so CPU tensors stand for CUDA ones: the
copies down and up, and each message's buffer of its own, are device-independent
(the order of the copies on CUDA streams: tests/test_cuda_staging.py).  Each
rank writes OUT/ops-rank-R.json, {name: {operation: times staged}}, so the test
can tell that the staging was on the path, not beside it.
"""
import json
import sys
from collections import Counter
from pathlib import Path

from allreduce.buffers import is_tensor
from allreduce.staging import HostStaged, HostStagedTransport
from allreduce.transport import Transport
from mpi4py import MPI

import strategies.engine.parallelize as parallelize
import strategies.sync.gradient_sync as gradient_sync
import strategies.sync.zero as zero
from strategies.train import main

STAGED = Counter()     # operation -> calls that went through the staging


class EveryTensor(HostStaged):
    """HostStaged as on a GPU: every tensor goes down to the host and back up."""

    def needs_host(self, x):
        return is_tensor(x)

    def allreduce(self, x, op="sum"):
        STAGED["allreduce"] += 1
        return super().allreduce(x, op)

    def broadcast(self, x, root=0):
        STAGED["broadcast"] += 1
        return super().broadcast(x, root)

    def reduce_scatter(self, x, op="sum"):
        STAGED["reduce_scatter"] += 1
        return super().reduce_scatter(x, op)

    def allgather(self, shard, n=None):
        STAGED["allgather"] += 1
        return super().allgather(shard, n)

    def alltoall(self, x, out=None):
        STAGED["alltoall"] += 1
        return super().alltoall(x, out)


class EveryMessage(HostStagedTransport):
    """HostStagedTransport as on a GPU: every message through a host buffer of its own."""

    def needs_host(self, x):
        return is_tensor(x)

    def isend(self, buf, peer, tag=0):
        STAGED["isend"] += 1
        return super().isend(buf, peer, tag)

    def irecv(self, buf, peer, tag=0):
        STAGED["irecv"] += 1
        return super().irecv(buf, peer, tag)


def as_on_a_gpu(coll, device):
    return EveryMessage(coll) if isinstance(coll, Transport) else EveryTensor(coll)


def train(out, name, flags, kind):
    main(flags + ["--jsonl", str(out / f"{name}-{kind}.jsonl"),
                  "--params-out", str(out / f"{name}-{kind}.npz")])


if __name__ == "__main__":
    out, runs = Path(sys.argv[1]), json.loads(sys.argv[2])
    plain = gradient_sync.for_device
    ops = {}
    for name, flags in runs:
        train(out, name, flags, "plain")
        # every module that asks for_device: collective_for's, the pipeline's, data_parallel's
        for module in (gradient_sync, parallelize, zero):
            module.for_device = as_on_a_gpu
        STAGED.clear()
        train(out, name, flags, "staged")
        ops[name] = dict(STAGED)
        for module in (gradient_sync, parallelize, zero):
            module.for_device = plain
    rank = MPI.COMM_WORLD.Get_rank()
    (out / f"ops-rank-{rank}.json").write_text(json.dumps(ops))
