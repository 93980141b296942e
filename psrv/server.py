"""One parameter-server shard: a ROUTER socket in front of a Shard (store.py).

    python -m psrv.server --shard 0 --num-shards 2 --bind tcp://127.0.0.1:5555
    python -m psrv.server --shard 0 --num-shards 1 --bind tcp://127.0.0.1:0   # random port
    python -m psrv.server ... --checkpoint-dir ckpt --checkpoint-every 100 [--resume]

It prints one line `psrv.server shard I listening on tcp://HOST:PORT` on stdout
(launch.start_local_servers reads it), logs to stderr, and exits once every
worker has said BYE or been declared dead.

The loop, one message at a time (a single thread owns the socket and the store):

    1. decode and validate the header (protocol.decode): bad -> ERROR reply, go on
    2. check the message against the store (known key, shape, dtype, step): bad -> ERROR
    3. INIT / PUSH / PUSH_PULL change the store; replies that the consistency
       model holds back wait in `pending` and are re-tried after every change
    4. every ~0.1 s: a worker silent for longer than worker_timeout (join_timeout
       before its first message, so a slow start is not a death) is dead;
       under BSP/SSP either the run fails (every waiting and later request gets an
       ERROR naming the worker) or the shard continues without it (a flag)

Workers send HEARTBEATs from a background thread, so a long forward pass is not
taken for death.  Replies reference the stored arrays zero-copy (store.Key.writable
copies a value before updating it if a reply still holds it).
"""
import argparse
import logging
import os
import sys
import time

import zmq

from . import protocol as P
from .config import unpack_config
from .store import Shard

log = logging.getLogger("psrv.server")
MAX_WORKERS = 4096
WORKER_OPS = {P.Op.INIT, P.Op.PUSH, P.Op.PULL, P.Op.PUSH_PULL, P.Op.HEARTBEAT, P.Op.BYE,
              P.Op.STATS, P.Op.CHECKPOINT}


class Server:
    def __init__(self, bind="tcp://127.0.0.1:0", shard=0, num_shards=1, worker_timeout=10.0,
                 on_worker_death="fail", checkpoint_dir=None, checkpoint_every=0, resume=False,
                 auth_key=None, max_frame_bytes=1 << 30, linger_ms=5000, join_timeout=60.0):
        if on_worker_death not in ("fail", "continue"):
            raise ValueError(f"on_worker_death must be 'fail' or 'continue', got {on_worker_death!r}")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} not in [0, {num_shards})")
        self.shard_id, self.num_shards = shard, num_shards
        self.worker_timeout, self.on_worker_death = worker_timeout, on_worker_death
        self.join_timeout = max(join_timeout, worker_timeout)   # slow starters are not dead
        self.joined = set()
        self.auth_key, self.linger_ms = auth_key, linger_ms
        self.checkpoint_every, self.last_checkpoint = checkpoint_every, 0
        self.checkpoint_path = (os.path.join(checkpoint_dir, f"shard{shard}-of-{num_shards}.npz")
                                if checkpoint_dir else None)
        self.store = Shard(shard)
        if resume and self.checkpoint_path and os.path.exists(self.checkpoint_path):
            self.store.load(self.checkpoint_path)
            self.last_checkpoint = min((k.version for k in self.store.keys.values()), default=0)
            log.info("shard %d resumed from %s at version %d", shard, self.checkpoint_path,
                     self.last_checkpoint)
        self.pending = []          # (identity, op, request, worker, entries) held back
        self.last_seen = {}        # worker -> time of its last message
        self.closed, self.dead = set(), set()
        self.failure = None        # the error every request gets once a BSP run failed
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)   # libzmq refuses larger frames
        self.sock.setsockopt(zmq.LINGER, linger_ms)             # let the last replies leave
        host, _, port = bind.rpartition(":")
        if port in ("0", "*"):
            port = self.sock.bind_to_random_port(host)
            bind = f"{host}:{port}"
        else:
            self.sock.bind(bind)
        self.endpoint = bind

    # -- the loop ----------------------------------------------------------------
    def serve(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        tick = min(0.1, self.worker_timeout / 4)
        while not self.finished():
            if poller.poll(tick * 1000):
                frames = self.sock.recv_multipart(copy=False)
                self.handle(frames[0].bytes, frames[1:])
            self.check_workers()
        self.sock.close()
        log.info("shard %d done: workers closed %s, dead %s", self.shard_id,
                 sorted(self.closed), sorted(self.dead))

    def finished(self):
        s = self.store
        return s.configured and self.last_seen and \
            len(self.closed | self.dead) >= s.num_workers

    def handle(self, identity, frames):
        request = P.peek_request(frames)
        try:
            msg = P.decode(frames, self.auth_key)
            if msg.op not in WORKER_OPS:
                raise P.ProtocolError(f"op {msg.op.name} is a reply, not a request")
            self.dispatch(identity, msg)
        except (P.ProtocolError, ValueError) as e:
            log.warning("shard %d: refused a message (request %d): %s", self.shard_id, request, e)
            self.reply_error(identity, request, str(e))
        except Exception as e:      # a bug must not take the shard down with it
            log.exception("shard %d: internal error", self.shard_id)
            self.reply_error(identity, request, f"internal error: {type(e).__name__}: {e}")

    def dispatch(self, identity, msg):
        s, w, op = self.store, msg.sender, msg.op
        if op == P.Op.HEARTBEAT:      # never answered: nobody reads the heartbeat socket
            if s.configured and w < s.num_workers and w not in self.dead:
                self.last_seen[w] = time.monotonic()
                self.joined.add(w)
            return
        if op != P.Op.INIT and not s.configured:
            raise ValueError(f"shard {self.shard_id} is not initialised: call init() first")
        if w >= (s.num_workers if s.configured else MAX_WORKERS):
            raise ValueError(f"sender {w} is not a worker id (W={s.num_workers})")
        if w in self.dead:
            raise ValueError(f"worker {w} was declared dead after {self.worker_timeout} s of silence")
        self.last_seen[w] = time.monotonic()
        self.joined.add(w)
        if op == P.Op.BYE:
            self.closed.add(w)
            s.drop_worker(w)      # BSP steps no longer wait for it
            self.release()
            return self.send(identity, P.encode(P.Op.OK, self.shard_id, msg.request, extras=[b"bye"]))
        if self.failure:
            raise ValueError(self.failure)
        if op == P.Op.STATS:
            return self.send(identity, P.encode(P.Op.STATS_REPLY, self.shard_id, msg.request,
                                                extras=[s.stats()]))
        if op == P.Op.CHECKPOINT:
            path = self.checkpoint(force=True)
            return self.send(identity, P.encode(P.Op.OK, self.shard_id, msg.request,
                                                extras=[path.encode()]))
        if op == P.Op.INIT:
            self.init(msg)
        else:
            for e in msg.entries:
                s.check_entry(e, w, push=op != P.Op.PULL)
            if op in (P.Op.PUSH, P.Op.PUSH_PULL):
                for e, frames in msg.entry_frames():
                    if not frames:
                        raise ValueError(f"key {e.key}: {op.name} without a gradient")
                for e, frames in msg.entry_frames():
                    s.push(e.key, w, frames)
        if op == P.Op.PUSH:
            self.send(identity, P.encode(P.Op.OK, self.shard_id, msg.request, extras=[b"pushed"]))
        else:
            self.pending.append((identity, op, msg.request, w, msg.entries))
        self.checkpoint()      # before the replies: a worker that has its values can rely on it
        self.release()

    def init(self, msg):
        opt, consistency, num_workers = unpack_config(bytes(msg.extras[0]))
        if not 0 < num_workers <= MAX_WORKERS or msg.sender >= num_workers:
            raise ValueError(f"INIT from worker {msg.sender} with W={num_workers}")
        names = bytes(msg.extras[1]).decode("utf-8", "replace").split("\n")
        if len(msg.extras[1]) > 256 * P.MAX_TEXT or len(names) != len(msg.entries):
            raise ValueError(f"INIT has {len(names)} names for {len(msg.entries)} entries")
        for e in msg.entries:
            if e.dtype != P.FLOAT32:
                raise ValueError(f"key {e.key}: dtype code {e.dtype}, servers hold float32 (code 0)")
        self.store.configure(opt, consistency, num_workers, msg.entries, names)
        for w in range(num_workers):   # death detection starts now: all should init about now
            self.last_seen.setdefault(w, time.monotonic())
        if msg.sender == 0 and not self.store.has_values:
            if any(not f for _, f in msg.entry_frames()):
                raise ValueError("worker 0's INIT must carry the initial value of every key")
            self.store.set_values(msg)

    # -- replies -------------------------------------------------------------------
    def release(self):
        """Send every held-back reply the consistency model now allows."""
        s, still = self.store, []
        for item in self.pending:
            identity, op, request, w, entries = item
            ready = s.has_values if op == P.Op.INIT else all(s.may_read(e.key, w) for e in entries)
            if ready:
                self.send_values(identity, request, w, entries)
            else:
                still.append(item)
        self.pending = still

    def send_values(self, identity, request, worker, entries):
        out, payload, held = [], [], []
        for e in entries:
            k = self.store.keys[e.key]
            parts = P.chunks(k.value)
            out.append(P.Entry(e.key, k.offset, k.length, k.shape, nframes=len(parts),
                               step=k.clock[worker], version=k.version,
                               staleness=k.staleness[worker]))
            payload += parts
            held += [k] * len(parts)
            k.read[worker] = k.version
        frames = P.encode(P.Op.VALUES, self.shard_id, request, out, payload=payload,
                          auth_key=self.auth_key)
        trackers = self.send(identity, frames)
        for k, t in zip(held, trackers[1:]):
            k.trackers.append(t)

    def send(self, identity, frames):
        """Send zero-copy; return one MessageTracker per frame."""
        self.sock.send(identity, zmq.SNDMORE)
        last = len(frames) - 1
        return [self.sock.send(f, 0 if i == last else zmq.SNDMORE, copy=False, track=True)
                for i, f in enumerate(frames)]

    def reply_error(self, identity, request, text):
        self.send(identity, P.error_message(self.shard_id, request, text, self.auth_key))

    # -- faults and checkpoints -----------------------------------------------------
    def check_workers(self):
        s, now = self.store, time.monotonic()
        for w, seen in list(self.last_seen.items()):
            limit = self.worker_timeout if w in self.joined else self.join_timeout
            if w in self.closed or w in self.dead or now - seen <= limit:
                continue
            self.dead.add(w)
            why = (f"worker {w} sent nothing for {now - seen:.1f} s "
                   f"({'worker' if w in self.joined else 'join'}_timeout {limit} s)")
            log.warning("shard %d: %s", self.shard_id, why)
            if self.on_worker_death == "fail" and s.consistency.mode != "asp":
                self.failure = (f"{why}; shard {self.shard_id} fails the {s.consistency.mode} run "
                                f"(on_worker_death='fail')")
                for identity, _, request, _, _ in self.pending:
                    self.reply_error(identity, request, self.failure)
                self.pending = []
            else:
                s.drop_worker(w)
                self.release()

    def checkpoint(self, force=False):
        s = self.store
        if not self.checkpoint_path or not s.has_values or not s.quiescent():
            if force:
                raise ValueError("cannot checkpoint now: no checkpoint dir, no values, "
                                 "or a BSP step is half pushed")
            return None
        version = min(k.version for k in s.keys.values())
        if force or (self.checkpoint_every and version >= self.last_checkpoint + self.checkpoint_every):
            s.save(self.checkpoint_path)
            self.last_checkpoint = version
            log.info("shard %d: checkpoint at version %d -> %s", self.shard_id, version,
                     self.checkpoint_path)
        return self.checkpoint_path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1)
    ap.add_argument("--bind", default="tcp://127.0.0.1:0", help="loopback unless told otherwise")
    ap.add_argument("--worker-timeout", type=float, default=10.0)
    ap.add_argument("--join-timeout", type=float, default=60.0,
                    help="seconds a worker may take to send its first message")
    ap.add_argument("--on-worker-death", choices=("fail", "continue"), default="fail")
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="versions between checkpoints")
    ap.add_argument("--resume", action="store_true", help="load the checkpoint if there is one")
    ap.add_argument("--auth-key-env", help="name of an environment variable holding the HMAC key")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    key = os.environ[a.auth_key_env].encode() if a.auth_key_env else None
    server = Server(a.bind, a.shard, a.num_shards, a.worker_timeout, a.on_worker_death,
                    a.checkpoint_dir, a.checkpoint_every, a.resume, key,
                    join_timeout=a.join_timeout)
    print(f"psrv.server shard {a.shard} listening on {server.endpoint}", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        server.sock.close(linger=0)


if __name__ == "__main__":
    main()
