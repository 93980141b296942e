"""psrv: a parameter server over ZeroMQ (sharded servers, push/pull, BSP/SSP/ASP).

    protocol.py   the wire format (one struct header + raw frames; the only place it is described)
    placement.py  parameter names -> slices -> servers, byte-balanced (BytePS-style slicing)
    optim.py      torch's SGD and Adam formulas in float32 numpy
    store.py      one shard's keys, optimizer state, consistency rules, checkpoints
    checkpoints.py  a shard's checkpoint files: its own, or its part of a set of one step
    server.py     the ROUTER loop: validation, held-back replies, dead and crashed workers
    roster.py     a shard's workers: who speaks for which id, who is alive, who has finished
    auth.py       who may talk to a server: CURVE, the ZAP allow-list, worker ids bound to keys
    keys.py       CURVE key files (python -m psrv.keys DIR --workers N), keys made under mpiexec
    client.py     the worker's side: push, pull, push_pull, handles
    link.py       a worker's socket to one server; replies read straight into `out`
    launch.py     roles under mpiexec, and local server processes for tests and benchmarks
    bench.py      push+pull throughput beside raw pyzmq and a torch.distributed.rpc server
    example.py    a small training run that uses all of the above
"""
from . import launch
from .client import Client, Handle, PSError
from .config import Consistency, OptimizerConfig
from .placement import Placement
from .protocol import ProtocolError

# psrv.keys (ClientKeys, ServerKeys, load_*) is not imported here, so that
# `python -m psrv.keys` runs it once, as launch keeps psrv.server out
__all__ = ["Client", "Handle", "PSError", "Consistency", "OptimizerConfig", "Placement",
           "ProtocolError", "launch"]
