"""Who serves and who trains, and where the servers are.

(a) Under MPI: the last S ranks serve, the others train.  Each server binds a
random port, and the endpoints are exchanged with one allgather:

    mpiexec -n 3 python -m mpi4py -m psrv.example --servers 1     # ranks 0,1 train; rank 2 serves

    role = psrv.launch.mpi_roles(MPI.COMM_WORLD, num_servers=S)
    if role.is_server:
        role.serve()                   # returns when every worker has closed
    else:
        client = psrv.Client(role.endpoints, role.worker_id, role.num_workers, keys=role.keys)
        ...                            # role.worker_comm: the workers only (for data sharding)

    Off loopback (bind_host="0.0.0.0") the servers are authenticated with no
    extra step: every rank makes a CURVE keypair and only the public keys are
    gathered (keys.for_mpi_rank); a server admits exactly the workers' keys.

(b) Standalone, one process per shard, on any hosts (keys: python -m psrv.keys):

    python -m psrv.keys keys --workers 2
    python -m psrv.server --shard 0 --num-shards 2 --bind tcp://h1:5555 --keys keys
    python -m psrv.server --shard 1 --num-shards 2 --bind tcp://h2:5555 --keys keys
    python -m psrv.example --ps tcp://h1:5555,tcp://h2:5555 --worker-id 0 --num-workers 2 --keys keys

`start_local_servers` runs (b) on this machine on Unix sockets (ipc://) in a private
directory, or random loopback ports (tests, bench).

A launcher that knows the keys before the servers start (shapes=, the name -> shape
table the workers' Client.init declares) tells each shard how many messages a worker
sends it in a step (step_messages): the shard sizes its receive queue by that, within
[8, 64], before it binds (server.receive_hwm), and never changes it.  Without shapes, as
from a shell, the queue holds 8.
"""
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from allreduce.records import checkout_pythonpath

from .placement import DEFAULT_SLICE_BYTES, Placement

# Besides its pushes and pulls, a worker may have a few control messages to a shard in
# flight in a step (STATS, CHECKPOINT, BYE or ABORT).
CONTROL_MESSAGES = 4


@dataclass
class Role:
    is_server: bool
    endpoints: list
    num_workers: int
    worker_id: int = None            # None on server ranks
    worker_comm: object = None       # the workers' sub-communicator; None on server ranks
    server: object = field(default=None, repr=False)   # a server.Server on server ranks
    keys: object = field(default=None, repr=False)     # a worker's keys.ClientKeys, off loopback

    def serve(self):
        self.server.serve()


def step_messages(shapes, num_servers, slice_bytes=DEFAULT_SLICE_BYTES):
    """The most messages one worker sends each shard in a step, from the keys (name ->
    shape, as Client.init declares them): the client cuts a call's slices on a shard
    into messages of at most message_bytes, each with one slice at least (Client.
    _requests), so a push or push_pull is at most one message per key the shard holds,
    a separate pull as many again, and a few control messages."""
    placement = Placement(shapes, num_servers, slice_bytes)
    return [2 * len(placement.on_server(s)) + CONTROL_MESSAGES for s in range(num_servers)]


def mpi_roles(comm, num_servers=1, bind_host="127.0.0.1", shapes=None,
              slice_bytes=DEFAULT_SLICE_BYTES, **server_options):
    """Split comm: ranks size-S .. size-1 serve (shard = rank - (size - S)), the rest train.
    Off loopback every rank takes part in one key exchange (collective).  shapes: the
    workers' keys, when this rank knows them before the servers start (step_messages)."""
    from .auth import is_local
    from .keys import for_mpi_rank
    from .server import Server      # here, so that `python -m psrv.server` imports it once
    rank, size = comm.Get_rank(), comm.Get_size()
    if not 0 < num_servers < size:
        raise ValueError(f"need 0 < servers({num_servers}) < ranks({size}): at least one worker")
    workers = size - num_servers
    keys = None if is_local(f"tcp://{bind_host}:0") else for_mpi_rank(comm, workers)
    server = None
    if rank >= workers:
        shard = rank - workers
        if shapes:
            server_options["step_messages"] = step_messages(shapes, num_servers,
                                                            slice_bytes)[shard]
        server = Server(f"tcp://{bind_host}:0", shard, num_servers, keys=keys,
                        **server_options)
        advertised = server.endpoint
        if bind_host in ("0.0.0.0", "*"):      # reachable name for other hosts
            advertised = server.endpoint.replace(bind_host, socket.gethostname())
    endpoints = comm.allgather(advertised if server else None)[workers:]
    sub = comm.Split(color=0 if server is None else 1, key=rank)
    if server is not None:
        sub.Free()
        return Role(True, endpoints, workers, server=server)
    return Role(False, endpoints, workers, worker_id=rank, worker_comm=sub, keys=keys)


class LocalServers:
    """S `python -m psrv.server` processes on this host; logs in temp files.  shapes: the
    workers' keys, so that each shard's receive queue holds one step's messages of a worker
    (step_messages; without them, 8).

    transport "ipc" (the default): Unix sockets in a fresh 0700 directory, which
    only this user can enter, so no one else on the host can connect; they skip
    the TCP stack (see docs/parameter-server.md, "Data path").  "tcp": random
    loopback ports (what a test that captures TCP bytes needs)."""

    def __init__(self, num_servers=1, timeout=30.0, transport="ipc", shapes=None,
                 slice_bytes=DEFAULT_SLICE_BYTES, **options):
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        counted = step_messages(shapes, num_servers, slice_bytes) if shapes else \
            [None] * num_servers
        self.procs, self.endpoints, self.logs, self.socket_dir = [], [], [], None
        try:            # an error or a signal while starting removes what was started
            self._start(num_servers, timeout, transport, counted, options)
        except BaseException:
            self.close()
            raise

    def _start(self, num_servers, timeout, transport, counted, options):
        self.socket_dir = tempfile.mkdtemp(prefix="psrv-") if transport == "ipc" else None
        for shard in range(num_servers):
            bind = (f"ipc://{self.socket_dir}/shard{shard}" if self.socket_dir
                    else "tcp://127.0.0.1:0")
            args = [sys.executable, "-m", "psrv.server", "--shard", str(shard),
                    "--num-shards", str(num_servers), "--bind", bind]
            counts = {} if counted[shard] is None else {"step_messages": counted[shard]}
            for k, v in {**options, **counts}.items():
                if v is True:
                    args.append("--" + k.replace("_", "-"))
                elif v not in (None, False):
                    args += ["--" + k.replace("_", "-"), str(v)]
            log = tempfile.NamedTemporaryFile("w+", prefix=f"psrv-shard{shard}-", suffix=".log",
                                              delete=False)
            self.logs.append(log.name)
            env = {**os.environ, "PYTHONPATH": checkout_pythonpath()}
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
            self.procs.append(proc)
            self.endpoints.append(self._read_endpoint(proc, timeout, log.name))

    @staticmethod
    def _read_endpoint(proc, timeout, log):
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if "listening on" not in line:
            proc.kill()
            raise RuntimeError(f"psrv.server did not start within {timeout} s; "
                               f"its log {log}:\n{open(log).read()[-2000:]}")
        return line.split()[-1]

    def log(self, shard):
        with open(self.logs[shard]) as f:
            return f.read()

    def kill(self, shard):
        self.procs[shard].send_signal(signal.SIGKILL)
        self.procs[shard].wait(10)

    def wait(self, timeout=30.0):
        """Wait for every server to exit on its own; returns their exit codes."""
        return [p.wait(timeout) for p in self.procs]

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            p.stdout.close()
        for name in self.logs:
            if os.path.exists(name):
                os.unlink(name)
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def start_local_servers(num_servers=1, **options):
    return LocalServers(num_servers, **options)
