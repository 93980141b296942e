"""The worker's side: push gradients to the shards that own them, pull fresh values back.

    client = psrv.Client(["ipc:///tmp/psrv-x/shard0", ...], worker_id=w, num_workers=W)
    step = client.init(params, psrv.OptimizerConfig("sgd", lr=0.1))   # worker 0's values win
    for step in range(step, steps):
        grads = compute(params)
        h = client.push_pull(grads, params, step)   # returns at once; ZeroMQ's I/O thread sends
        ...                                         # (overlap: compute something else here)
        h.wait()                                    # params now hold the servers' values
    client.close()

    with psrv.Client(...) as client:    # an exception inside tells the servers ABORT, not BYE
        ...

Across hosts the servers are CURVE servers: pass keys=psrv.keys.ClientKeys (from
psrv.keys.load_worker_keys, or launch.mpi_roles's role.keys).  Every socket is
then authenticated and encrypted, and a server that refuses this worker's key
is reported at once (PSError), not after the timeout.

Like MPI_Isend, a non-blocking call sends the caller's arrays zero-copy: do not
write to `grads` before `wait()` returns.  Like MPI_Irecv, it receives straight
into `out` (ZeroMQ's recv_into), at any time before `wait()` returns (a wait on
another handle stores the replies it meets): do not read `out` before then.

One link (link.py: a DEALER socket, and the reading of replies) per server.  The
keys of one step are batched per server into messages of at most `message_bytes`
(big tensors arrive already cut into slices by Placement), so a server can update
and return the first slices while the later ones are still on the wire.  Replies are matched to requests by request
id; a reply for another request found while waiting is kept for its handle.
Every wait has a deadline and ends in a PSError naming the server.
"""
import itertools
import os
import threading
import time

import numpy as np
import zmq

from . import auth, heap
from . import protocol as P
from .config import Consistency, pack_config
from .link import Link, PSError
from .placement import DEFAULT_SLICE_BYTES, Placement


class Handle:
    """The requests of one non-blocking call; wait() completes them all.  pushed_bytes:
    the payload bytes its pushes put on the wire (the gradients, as encoded)."""

    def __init__(self, client, requests, pushed_bytes=0):
        self.client, self.requests, self.done = client, requests, False
        self.pushed_bytes = pushed_bytes

    def wait(self):
        if not self.done:
            deadline = time.monotonic() + self.client.timeout
            for server, request, op, out in self.requests:
                self.client._complete(server, request, op, out, deadline)
            self.done = True


class Client:
    def __init__(self, endpoints, worker_id, num_workers, timeout=30.0, consistency=None,
                 keys=None, heartbeat_interval=0.5, slice_bytes=DEFAULT_SLICE_BYTES,
                 message_bytes=4 << 20, wire="fp32", encoder=None):
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id {worker_id} not in [0, num_workers={num_workers})")
        if not endpoints:
            raise ValueError("no server endpoints")
        open_endpoints = [e for e in endpoints if not auth.is_local(e)]
        if keys is None and open_endpoints:      # never send gradients in clear off this host
            raise ValueError(f"server endpoints {', '.join(open_endpoints)} are off loopback: "
                             f"pass keys (psrv.keys; --keys DIR on the command line)")
        self.endpoints, self.worker_id, self.num_workers = list(endpoints), worker_id, num_workers
        self.timeout, self.keys = timeout, keys
        if keys is not None and len(keys.servers) not in (1, len(self.endpoints)):
            raise ValueError(f"{len(keys.servers)} server keys for {len(self.endpoints)} endpoints")
        self.consistency = consistency or Consistency()
        if wire not in P.WIRE_DTYPES:
            raise ValueError(f"wire {wire!r}: choose {', '.join(P.WIRE_DTYPES)}")
        # pushes carry gradients in this dtype, or as `encoder` encodes each slice:
        # encoder(slice, its float32 gradient) -> (dtype code, param, payload array), in
        # protocol.py's layout (a lossy compressor's, strategies/sync/server_buckets.py);
        # the servers decode, sum and step in float32
        self.wire = P.WIRE_DTYPES[wire]
        self.encoder = encoder or self._cast
        self.slice_bytes, self.message_bytes = slice_bytes, message_bytes
        self.placement = None
        self.staleness_log = []
        self._ids = itertools.count(1)
        self._stash = [dict() for _ in self.endpoints]      # request id -> early reply
        self._expect = [dict() for _ in self.endpoints]     # request id -> out, for its VALUES
        self._slices = [{} for _ in self.endpoints]          # server -> {key: Slice}
        self._numel = {}                                    # parameter name -> elements
        self._mine = set()                                  # the names this worker pushes
        self._start_steps = {}                              # INIT request id -> clock
        heap.tune()          # reuse freed 1 MiB frames instead of faulting in fresh pages
        self._ctx = zmq.Context()
        # routing ids of our own (protocol.routing_ids): a reconnect after a network blip
        # is the same connection to the server, and the heartbeats' twin id proves
        # they come from this worker
        self._ids_of = [P.routing_ids(os.urandom(15)) for _ in self.endpoints]
        self._links = [self._link(i, self._ids_of[i][0]) for i in range(len(self.endpoints))]
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_interval,), daemon=True)
        self._beat.start()
        self.closed = False

    # -- the API ----------------------------------------------------------------------
    def init(self, params, optimizer, consistency=None, group=None, shapes=None):
        """Declare params on the servers (worker 0's values win), then copy the servers'
        values into params.  Returns the step to start from (> 0 after a resume).

        Under a model split, workers hold different parameters: `group` (worker ids,
        this one among them) are the workers that push these params, the data-parallel
        replicas of this worker's piece, and the first of them brings their values;
        `shapes` are every group's parameters (name -> shape), the same on every worker,
        so that all of them number the keys alike (placement.py).  None: every worker
        pushes every parameter, params' own shapes."""
        if consistency is not None:
            self.consistency = consistency
        for name, p in params.items():
            _check_out(name, p)
        if group is not None:
            group = tuple(sorted(int(w) for w in group))
            if self.worker_id not in group or max(group) >= self.num_workers:
                raise ValueError(f"group {list(group)[:8]} must hold worker {self.worker_id} "
                                 f"and ids below num_workers={self.num_workers}")
        shapes = {n: p.shape for n, p in params.items()} if shapes is None else dict(shapes)
        for name, p in params.items():
            if tuple(shapes.get(name, ())) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(p.shape)}, shapes say "
                                 f"{shapes.get(name)}")
        self.placement = Placement(shapes, len(self.endpoints), self.slice_bytes)
        mine = [[sl for sl in self.placement.on_server(s) if sl.name in params]
                for s in range(len(self.endpoints))]
        self._slices = [{sl.key: sl for sl in slices} for slices in mine]
        self._numel = {n: p.size for n, p in params.items()}
        self._mine = set(params)
        config = pack_config(optimizer, self.consistency, self.num_workers)
        extras = [config] if group is None else [config, np.array(group, "<i4")]
        first = 0 if group is None else group[0]
        requests = []
        # every server hears from every worker (its roster counts W), with no keys where
        # it holds none of this worker's
        for server, slices in enumerate(mine):
            source = params if self.worker_id == first else {}
            entries, payload = self._entries(slices, source, step=0)
            names = "\n".join(sl.name for sl in slices).encode()
            requests.append(self._send(server, P.Op.INIT, entries, payload,
                                       [extras[0], names, *extras[1:]], params,
                                       flags=0 if group is None else P.GROUP))
        Handle(self, requests).wait()
        steps = [self._start_steps.pop(request) for _, request, _, _ in requests]
        return min((s for s in steps if s is not None), default=0)

    def push_pull(self, grads, out, step):
        """Non-blocking: push grads for `step`, and fill `out` with the updated values on wait()."""
        return Handle(self, *self._requests(P.Op.PUSH_PULL, grads, step, out))

    def push_async(self, grads, step):
        return Handle(self, *self._requests(P.Op.PUSH, grads, step, None))

    def pull_async(self, out):
        return Handle(self, *self._requests(P.Op.PULL, {n: None for n in out}, 0, out))

    def push(self, name, grad, step):
        self.push_async({name: grad}, step).wait()

    def pull(self, name, out):
        self.pull_async({name: out}).wait()

    def stats(self):
        """Merged over servers: {'histogram': {staleness: count}, 'max_clock_gap': g}."""
        hist, gap = {}, 0
        for server in range(len(self.endpoints)):
            a = np.frombuffer(self._call(server, P.Op.STATS).extras[0], np.int64)
            gap = max(gap, int(a[0]))
            for s, c in a[2:2 + 2 * int(a[1])].reshape(-1, 2):
                hist[int(s)] = hist.get(int(s), 0) + int(c)
        return {"histogram": dict(sorted(hist.items())), "max_clock_gap": gap}

    def checkpoint(self, step=None):
        """Ask every shard to write its checkpoint now; returns their paths.  step: save
        it as the shards' part of the checkpoint set of `step` (checkpoints.py), which a
        shard refuses unless every live worker is exactly at `step`; None: its own file."""
        frame = P.CHECKPOINT_STEP.pack(-1 if step is None else step)
        return [bytes(self._call(s, P.Op.CHECKPOINT, [frame]).extras[0]).decode()
                for s in range(len(self.endpoints))]

    def close(self, error=None):
        """Say BYE to every server, or ABORT with `error` (a crash, which under BSP/SSP
        fails the run on the other workers); best effort, bounded; close the sockets."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        op, extras = (P.Op.BYE, []) if error is None else (P.Op.ABORT, [str(error).encode()[:P.MAX_TEXT]])
        byes = []
        for s in (s for s, link in enumerate(self._links) if link.refused is None):
            try:
                byes.append(self._send(s, op, [], [], extras, None, nowait=True))
            except PSError:
                pass             # nothing queued to that server: it cannot be told
        deadline = time.monotonic() + min(self.timeout, 5.0)     # one deadline for all
        for server, request, op, _ in byes:
            try:
                self._receive(server, request, deadline, op)
            except PSError:
                pass             # a dead server cannot be told; its timeout already told us
        self._beat.join(timeout=5)
        for link in self._links:
            link.close()
        self._ctx.term()

    @property
    def bytes_sent(self):
        return sum(link.bytes_sent for link in self._links)

    @property
    def bytes_received(self):
        return sum(link.bytes_received for link in self._links)

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        self.close(error=None if kind is None else f"{kind.__name__}: {exc}")

    def _link(self, server, routing_id=None, watch=True):
        return Link(self._ctx, self.endpoints[server],
                    f"worker {self.worker_id}: server {server} ({self.endpoints[server]})",
                    self.timeout, self.keys, self.keys and self.keys.server(server),
                    routing_id, watch)

    # -- requests ----------------------------------------------------------------------
    def _requests(self, op, arrays, step, out):
        if self.placement is None:
            raise PSError("call init() before push/pull")
        for name in arrays:
            if name not in self._mine:
                raise KeyError(f"{name!r} was not declared in init()")
        if out is not None:
            for name, o in out.items():
                _check_out(name, o, self.placement.by_name[name][0].shape)
        by_server = {}
        for name in sorted(arrays):
            for sl in self.placement.by_name[name]:
                by_server.setdefault(sl.server, []).append(sl)
        requests, pushed = [], 0
        source = arrays if op != P.Op.PULL else {}
        encode = self.encoder if op in (P.Op.PUSH, P.Op.PUSH_PULL) else None
        for server, slices in sorted(by_server.items()):
            # batch: consecutive slices up to message_bytes (of float32) per message
            batch, size = [], 0
            for sl in slices + [None]:
                nbytes = sl.length * 4 if sl else 0
                if batch and (sl is None or size + nbytes > self.message_bytes):
                    entries, payload = self._entries(batch, source, step, encode)
                    requests.append(self._send(server, op, entries, payload, [], out))
                    pushed += sum(memoryview(p).nbytes for p in payload)
                    batch, size = [], 0
                if sl:
                    batch.append(sl)
                    size += nbytes
        return requests, pushed

    def _cast(self, sl, piece):
        """A push's slice as `wire` carries it: float32, or a 16-bit cast."""
        return self.wire, 0, P.to_wire(piece, self.wire)

    def _entries(self, slices, arrays, step, encode=None):
        """The entries and payload frames of `slices`: float32 values (INIT), or a push's
        gradients as `encode` (the client's encoder) carries them."""
        entries, payload = [], []
        for sl in slices:
            parts, dtype, param = [], P.FLOAT32, 0
            if sl.name in arrays:
                flat = np.ascontiguousarray(arrays[sl.name], dtype=np.float32).reshape(-1)
                if flat.size != self._numel[sl.name]:
                    raise ValueError(f"{sl.name}: {flat.size} elements, declared shape {sl.shape}")
                piece = flat[sl.offset:sl.offset + sl.length]
                if encode is not None:
                    dtype, param, piece = encode(sl, piece)
                parts = P.chunks(piece)
            entries.append(P.Entry(sl.key, sl.offset, sl.length, sl.shape, dtype=dtype,
                                   nframes=len(parts), step=step, param=param))
            payload += parts
        return entries, payload

    def _send(self, server, op, entries, payload, extras, out, nowait=False, flags=0):
        request = next(self._ids)
        frames = P.encode(op, self.worker_id, request, entries, extras, payload, flags)
        now = time.monotonic()
        self._links[server].send(frames, now if nowait else now + self.timeout, f"took no {op.name}")
        if out is not None:
            self._expect[server][request] = out
        return (server, request, op, out)

    def _call(self, server, op, extras=(), timeout=None):
        s, request, _, _ = self._send(server, op, [], [], list(extras), None)
        return self._receive(s, request, time.monotonic() + (timeout or self.timeout), op)

    def _receive(self, server, request, deadline, op):
        """The reply to `request` from `server`, or PSError at the deadline.  Replies to
        other requests met on the way are kept (their VALUES already in their out)."""
        link, stash = self._links[server], self._stash[server]
        while request not in stash:
            link.wait(zmq.POLLIN, deadline, f"sent no reply to {op.name} (request {request})")
            msg = link.read(self._expect[server], self._slices[server])
            stash[msg.request] = msg
        msg = stash.pop(request)
        if msg.op == P.Op.ERROR:
            text = bytes(msg.extras[0]).decode("utf-8", "replace")
            raise PSError(f"{link.name} refused {op.name}: {text}")
        return msg

    def _complete(self, server, request, op, out, deadline):
        """Wait for the reply; VALUES' payload is already in out (Link.read)."""
        msg = self._receive(server, request, deadline, op)
        if msg.op != P.Op.VALUES:
            return
        if op == P.Op.INIT:
            # None: a server that holds none of this worker's keys has no step to say
            self._start_steps[request] = min((e.step for e in msg.entries), default=None)
        elif op == P.Op.PUSH_PULL:
            self.staleness_log += [e.staleness for e in msg.entries if e.staleness >= 0]

    def _heartbeat(self, interval):
        """Runs in a thread with its own sockets (ZeroMQ sockets are not thread-safe)."""
        links = [self._link(i, self._ids_of[i][1], watch=False) for i in range(len(self.endpoints))]
        try:
            while not self._stop.wait(interval):
                for link in links:
                    try:
                        link.sock.send_multipart(P.encode(P.Op.HEARTBEAT, self.worker_id, 0),
                                                 zmq.NOBLOCK)
                    except zmq.Again:
                        pass     # no peer or a full queue: a missed heartbeat is no harm
        finally:
            for link in links:
                link.close()


def _check_out(name, a, shape=None):
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous
            and a.flags.writeable):
        raise ValueError(f"{name}: need a writable C-contiguous float32 numpy array")
    if shape is not None and a.shape != tuple(shape):
        raise ValueError(f"{name}: shape {a.shape}, declared {tuple(shape)}")
