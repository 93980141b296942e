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

Each shard sizes its receive queue by how many messages a worker sends it in a step
(step_messages, counted from the keys: the name -> shape table the workers' Client.init
declares), within [8, 64], before it binds (server.receive_hwm), and never changes it.
A launcher that knows the keys before the servers start passes them (shapes=).  Where
the workers learn their keys only later (a trainer's buckets exist once its model is
built), mpi_roles(await_keys=True) makes the servers wait for them:

    role = mpi_roles(comm, num_servers=S, await_keys=True)
    if role.is_server:
        role.serve()                   # waits for the keys, binds, then serves
    else:
        ...                            # build the model, cut its buckets: shapes
        role.declare(shapes, timeout)  # every worker; now role.endpoints is known
        client = psrv.Client(role.endpoints, ...)

Without either, as from a shell, the queue holds 8.
"""
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from allreduce.records import checkout_pythonpath

from .link import PSError
from .placement import DEFAULT_SLICE_BYTES, Placement

log = logging.getLogger("psrv.launch")
# Besides its pushes and pulls, a worker may have a few control messages to a shard in
# flight in a step (STATS, CHECKPOINT, BYE or ABORT).
CONTROL_MESSAGES = 4
# The tag of the keys' and the endpoints' messages (KeysFirst), on a communicator of their own
KEYS_TAG = 7


@dataclass
class Role:
    is_server: bool
    endpoints: list                  # None until declare() under await_keys
    num_workers: int
    worker_id: int = None            # None on server ranks
    worker_comm: object = None       # the workers' sub-communicator; None on server ranks
    server: object = field(default=None, repr=False)   # a server.Server on server ranks
    keys: object = field(default=None, repr=False)     # a worker's keys.ClientKeys, off loopback
    keys_first: object = field(default=None, repr=False)   # a KeysFirst under await_keys

    def serve(self):
        """A server rank: serve until every worker has closed (under await_keys, first
        wait for the workers' keys and bind)."""
        if self.server.listener is None and not self.keys_first.listen(self.server):
            return                       # stopped by a signal before the keys came
        self.server.serve()

    def declare(self, shapes, timeout):
        """Every worker rank, with the same shapes (name -> shape, every key of every
        worker): under await_keys the servers bind for them and role.endpoints is set;
        else nothing to do.  Raises TimeoutError naming the silent servers after
        `timeout` s, PSError with a server's own error if one could not bind."""
        if self.endpoints is None:
            self.endpoints = self.keys_first.declare(shapes, timeout)
        return self.endpoints


class KeysFirst:
    """The servers bind once the workers know their keys: rank 0 (a worker) sends the
    key table to every server, each server binds with a receive queue of one step of a
    worker (step_messages) and sends its endpoint, or why it could not bind, to every
    worker.  Point to point on a duplicate of the communicator, each receive polled
    against a deadline, so that a rank that never comes is named instead of waited for
    (the sends, a key table and an endpoint, are small enough to leave at once: MPI's
    eager protocol).  keys_timeout: how long a server waits for the keys, the time the
    workers may take to build their model and cut it into buckets."""

    def __init__(self, comm, workers, bind_host, slice_bytes, keys_timeout):
        self.comm = comm.Dup()               # collective: in mpi_roles, on every rank
        self.workers, self.bind_host, self.slice_bytes = workers, bind_host, slice_bytes
        self.keys_timeout = keys_timeout
        self.servers = list(range(workers, comm.Get_size()))

    def declare(self, shapes, timeout):
        """A worker: the keys to the servers (rank 0 sends them), their endpoints back."""
        sends = [self.comm.isend(shapes, dest=s, tag=KEYS_TAG) for s in self.servers] \
            if self.comm.Get_rank() == 0 else []
        replies = self._receive(self.servers, timeout, "the servers' endpoints")
        for r in sends:
            r.wait()
        self.comm.Free()                     # every message of the exchange is in
        problems = [f"server rank {s}: {why}" for s, (_, why) in replies.items() if why]
        if problems:
            raise PSError("; ".join(problems))
        return [replies[s][0] for s in self.servers]

    def listen(self, server):
        """A server: wait for the keys (within keys_timeout), bind, answer.  False if
        SIGINT/SIGTERM came first: there is nothing to serve, save or drain yet."""
        signals = []
        note = lambda signum, frame: signals.append(signum)      # noqa: E731
        old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)} \
            if threading.current_thread() is threading.main_thread() else {}
        try:
            got = self._receive([0], self.keys_timeout, "the workers' keys",
                                stopped=lambda: bool(signals))
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if got is None:
            log.warning("shard %d: %s before the workers declared their keys: nothing to "
                        "serve", server.shard_id, signal.Signals(signals[0]).name)
            return False
        shapes = got[0]
        endpoint, why = None, None
        try:
            counted = step_messages(shapes, server.num_shards, self.slice_bytes)
            endpoint = advertised(server.listen(counted[server.shard_id]), self.bind_host)
        except Exception as e:           # told to every worker, then raised here
            why = f"{type(e).__name__}: {e}"
        for r in [self.comm.isend((endpoint, why), dest=w, tag=KEYS_TAG)
                  for w in range(self.workers)]:
            r.wait()
        self.comm.Free()
        if why:
            raise PSError(f"shard {server.shard_id} could not bind: {why}")
        return True

    def _receive(self, sources, timeout, what, stopped=lambda: False):
        """{source: its message}, polled until every source's came or `timeout` s passed;
        None once stopped() says so."""
        got, deadline = {}, time.monotonic() + timeout
        while len(got) < len(sources):
            if stopped():
                return None
            for s in sources:
                if s not in got:
                    msg = self.comm.improbe(source=s, tag=KEYS_TAG)
                    if msg is not None:
                        got[s] = msg.recv()
            if len(got) < len(sources):
                if time.monotonic() > deadline:
                    silent = ", ".join(f"rank {s}" for s in sources if s not in got)
                    raise TimeoutError(f"rank {self.comm.Get_rank()}: waited {timeout:g} s for "
                                       f"{what} from {silent} (stopped, failed or gone)")
                time.sleep(0.002)        # leaves the cores to ranks still building
        return got


def advertised(endpoint, bind_host):
    """The endpoint other hosts reach: the host's name where the server binds every
    interface."""
    if bind_host in ("0.0.0.0", "*"):
        return endpoint.replace(bind_host, socket.gethostname())
    return endpoint


def step_messages(shapes, num_servers, slice_bytes=DEFAULT_SLICE_BYTES):
    """The most messages one worker sends each shard in a step, from the keys (name ->
    shape, as Client.init declares them): the client cuts a call's slices on a shard
    into messages of at most message_bytes, each with one slice at least (Client.
    _requests), so a push or push_pull is at most one message per key the shard holds,
    a separate pull as many again, and a few control messages."""
    placement = Placement(shapes, num_servers, slice_bytes)
    return [2 * len(placement.on_server(s)) + CONTROL_MESSAGES for s in range(num_servers)]


def mpi_roles(comm, num_servers=1, bind_host="127.0.0.1", shapes=None,
              slice_bytes=DEFAULT_SLICE_BYTES, await_keys=False, keys_timeout=600.0,
              **server_options):
    """Split comm: ranks size-S .. size-1 serve (shard = rank - (size - S)), the rest train.
    Off loopback every rank takes part in one key exchange (collective).  shapes: the
    workers' keys, when this rank knows them before the servers start (step_messages);
    await_keys: the workers declare them later (Role.declare), and the servers bind then,
    waiting for them at most keys_timeout seconds.  A server that cannot start (a bad
    option, a damaged shard to resume) raises PSError on every rank, naming it."""
    from .auth import is_local
    from .keys import for_mpi_rank
    from .server import Server      # here, so that `python -m psrv.server` imports it once
    rank, size = comm.Get_rank(), comm.Get_size()
    if not 0 < num_servers < size:
        raise ValueError(f"need 0 < servers({num_servers}) < ranks({size}): at least one worker")
    if await_keys and shapes:
        raise ValueError("pass shapes= or await_keys=True, not both")
    workers = size - num_servers
    keys = None if is_local(f"tcp://{bind_host}:0") else for_mpi_rank(comm, workers)
    keys_first = KeysFirst(comm, workers, bind_host, slice_bytes, keys_timeout) \
        if await_keys else None
    server = problem = None
    if rank >= workers:
        shard = rank - workers
        if shapes:
            server_options["step_messages"] = step_messages(shapes, num_servers,
                                                            slice_bytes)[shard]
        try:
            server = Server(f"tcp://{bind_host}:0", shard, num_servers, keys=keys,
                            listen=not await_keys, **server_options)
        except Exception as e:       # every rank hears of it, instead of waiting below
            problem = f"shard {shard} (rank {rank}) could not start: {type(e).__name__}: {e}"
    # the endpoints (bound now, or at the declaration), and any server's failure to start
    told = comm.allgather((advertised(server.endpoint, bind_host)
                           if server and server.endpoint else None, problem))
    failed = [why for _, why in told if why]
    if failed:
        raise PSError("; ".join(failed))
    endpoints = None if await_keys else [endpoint for endpoint, _ in told[workers:]]
    sub = comm.Split(color=0 if server is None else 1, key=rank)
    if server is not None:
        sub.Free()
        return Role(True, endpoints, workers, server=server, keys_first=keys_first)
    return Role(False, endpoints, workers, worker_id=rank, worker_comm=sub, keys=keys,
                keys_first=keys_first)


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
