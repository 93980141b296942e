"""One parameter-server shard: a ROUTER socket in front of a Shard (store.py).

    python -m psrv.server --shard 0 --num-shards 2 --bind tcp://127.0.0.1:5555
    python -m psrv.server --shard 0 --num-shards 1 --bind tcp://127.0.0.1:0   # random port
    python -m psrv.server ... --bind ipc://DIR/shard0     # this host only: DIR of mode 0700
    python -m psrv.server ... --bind tcp://0.0.0.0:5555 --keys DIR   # other hosts: CURVE keys
    python -m psrv.server ... --checkpoint-dir ckpt --checkpoint-every 100 [--resume]
    python -m psrv.server ... --step-messages 10    # queue one step of a worker (launch.py)

It prints one line `psrv.server shard I listening on ENDPOINT` on stdout
(launch.start_local_servers reads it), logs to stderr, and exits once every
worker has said BYE or been declared dead, or on SIGINT/SIGTERM (after writing
its checkpoint when it has a --checkpoint-dir; on_signal="drain": it writes nothing
and serves on until its workers have closed, as they write the checkpoint set of the
step they stop at, checkpoints.py; a second signal stops it).  A non-loopback
--bind without --keys (python -m psrv.keys) is refused: nobody else may drive
the servers.

The loop, one message at a time (a single thread owns the sockets and the store):

    0. with keys: the CURVE handshake and ZAP allow-list (auth.py) run before any
       message arrives; every message then carries its client key, and a key speaks
       on at most auth.KEY_CONNECTIONS connections (a further one is cut).  With keys
       or without, a connection above 2 per worker + auth.SPARE_CONNECTIONS is cut
       when it is accepted (auth.Connections: W from the key set, or from the INIT)
    1. decode and validate the header (protocol.decode): bad -> ERROR reply, go on
    2. who is speaking (roster.py): a connection speaks for one worker id; with keys a
       worker id belongs to its own client key, without to the first connection using it
    3. check the message against the store (known key, shape, dtype, step): bad -> ERROR
    4. INIT / PUSH / PUSH_PULL change the store; replies that the consistency
       model holds back wait in `pending` and are re-tried after every change
    5. every ~0.1 s: a worker silent for longer than worker_timeout (join_timeout
       before its first message, so a slow start is not a death) is dead (roster.py).  A dead
       or crashed (ABORT) worker under BSP/SSP either fails the run (every waiting
       and later request gets an ERROR naming the worker) or the shard continues
       without it (on_worker_death); a BYE is a clean finish and never fails a run
    6. TRIM_QUIET_S after the last refused message or departed worker: the heap's
       free pages go back to the kernel (heap.trim), so a flood leaves nothing behind

Pushed gradients are used where ZeroMQ received them (the optimizer reads the
frames in place), and replies reference the stored arrays zero-copy
(store.Key.writable copies a value before updating it if a reply still holds it).
ZeroMQ hands a multipart message over whole, so the unit of pipelining is the
message: the client cuts a push into messages of ~message_bytes, and the shard
updates and answers each while the next ones are on the wire.
"""
import argparse
import logging
import signal
import sys
import threading
import time

import zmq

from . import auth, heap
from . import protocol as P
from .checkpoints import ShardCheckpoints, requested_step
from .config import check_server_options, unpack_config
from .keys import load_server_keys
from .replies import Outbox, UnreadReplies
from .roster import MAX_WORKERS, Roster
from .store import Shard

log = logging.getLogger("psrv.server")
WORKER_OPS = {P.Op.INIT, P.Op.PUSH, P.Op.PULL, P.Op.PUSH_PULL, P.Op.HEARTBEAT, P.Op.BYE,
              P.Op.STATS, P.Op.CHECKPOINT, P.Op.ABORT}
# Messages ZeroMQ queues per connection before the shard reads them (RCVHWM).  libzmq's
# default, 1000, would let a worker that pushes faster than the shard applies its pushes
# park gigabytes in the shard (1000 messages of message_bytes, 4 MiB by default).  A
# launcher that knows the keys counts one step's messages of a worker for each shard
# (launch.step_messages): at that mark a worker that keeps to its step is never held back
# by the shard's queue, and one that runs ahead waits in its own queue and the kernel's
# socket buffers (ZeroMQ stops reading a connection whose queue is full; nothing is
# dropped).  receive_hwm keeps the mark within
#   RECEIVE_HWM, 8, the floor, and the mark of a shard started without a count (by
#     hand): room for an INIT and a few control messages, 32 MiB of a worker's unread
#     4 MiB pushes, ample for throughput (the shard takes a message in a few milliseconds
#     while its I/O thread receives the next ones);
#   MOST_RECEIVE_HWM, 64, the ceiling: a peer's messages are bounded per frame only
#     (MAXMSGSIZE, protocol.MAX_FRAME_BYTES), so a connection may park the mark x 4 MiB
#     of one-frame messages, 256 MiB at 64 (a shard of 30 keys or more), not libzmq's
#     gigabytes; a longer step streams through the queue, as at 8.
# The mark is set once, before the bind, and never changed: changed on open connections
# it can stall a pipe (libzmq's reader wakes a blocked writer only when its count of
# messages read reaches a multiple of half the mark in force, pipe_t::read; after a
# change the reader can drain the pipe without reaching one, and the writer waits on).
RECEIVE_HWM = 8
MOST_RECEIVE_HWM = 64
# Replies queued per connection (libzmq's default, stated): a worker gets about
# (its bytes on this shard) / message_bytes replies a step (a ROUTER drops replies beyond
# it).  Their bytes are bounded by max_unread (replies.py), not by this count.
SEND_HWM = 1000
# After a refused message or a worker that left, the shard trims its heap once this long
# has passed without another (trim_later): long enough that a flood is over, short enough
# that its memory is back within a second or two of the last refusal.
TRIM_QUIET_S = 1.0
# A worker may leave this much more than two copies of the shard's values unread
# (replies.py: a pull and a push_pull in flight) before the shard stops serving it.
UNREAD_MARGIN = 64 << 20


class Server:
    def __init__(self, bind="tcp://127.0.0.1:0", shard=0, num_shards=1, worker_timeout=10.0,
                 on_worker_death="fail", checkpoint_dir=None, checkpoint_every=0, resume=False,
                 keys=None, linger_ms=5000, join_timeout=60.0, max_unread=None,
                 on_signal="checkpoint", resume_step=None, step_messages=None, listen=True):
        """listen=False: everything but the bind, which listen() does later, once the
        workers' keys (and so their step's messages) are known (launch.mpi_roles)."""
        check_server_options(shard, num_shards, worker_timeout, join_timeout, on_worker_death,
                             checkpoint_every, max_unread, on_signal, step_messages)
        if keys is None and not auth.is_local(bind):
            raise ValueError(f"refusing to bind {bind} without authentication: anyone who reaches "
                             f"it could drive the servers; pass --keys DIR (python -m psrv.keys DIR "
                             f"--workers N) or keys=ServerKeys, or bind 127.0.0.1")
        if keys is None and bind.startswith("ipc://"):
            auth.check_private_ipc(bind)
        self.bind, self.shard_id, self.num_shards, self.keys = bind, shard, num_shards, keys
        self.worker_timeout, self.on_worker_death = worker_timeout, on_worker_death
        self.join_timeout = join_timeout
        self.linger_ms, self.max_unread, self.on_signal = linger_ms, max_unread, on_signal
        self.checkpoints = ShardCheckpoints(checkpoint_dir, shard, num_shards, checkpoint_every,
                                            resume_step) if checkpoint_dir else None
        heap.tune()          # reuse freed 1 MiB frames instead of faulting in fresh pages
        heap.one_arena()     # before ZeroMQ's I/O thread: its frames trimmable (heap.trim)
        self.store = Shard(shard)
        loaded = self.checkpoints.load(self.store) if resume and self.checkpoints else None
        if loaded:
            log.info("shard %d resumed from %s at step %d", shard, loaded,
                     self.store.steps_done())
        self.pending = []          # (identity, op, request, worker, entries) held back
        self.roster = Roster(worker_timeout, join_timeout, keys and keys.clients)
        self.failure = None        # the error every request gets once a BSP run failed
        self.stop_signal, self.signals = None, 0      # the last signal, how many so far
        self.trim_at = None        # when to give a flood's memory back (trim_later)
        self.listener = self.sock = self.endpoint = self.outbox = None
        if listen:
            self.listen(step_messages)

    def listen(self, step_messages=None):
        """Bind, with a receive queue of one step's messages of a worker (receive_hwm),
        set before the bind and never changed."""
        hwm = receive_hwm(step_messages)
        self.listener = auth.Listener(self.bind, self.keys, f"shard {self.shard_id}",
                                      self.linger_ms, hwm, SEND_HWM)
        self.sock, self.endpoint = self.listener.sock, self.listener.endpoint
        self.outbox = Outbox(self.sock, self.shard_id)
        log.info("shard %d on %s: %s; %d messages queued per connection (%s)", self.shard_id,
                 self.endpoint, f"CURVE, {len(self.keys.clients)} client keys" if self.keys
                 else "no authentication (local only)", hwm,
                 "no step size given" if step_messages is None else
                 f"a worker's step: {step_messages}")
        return self.endpoint

    # -- the loop ----------------------------------------------------------------
    def serve(self):
        poller = zmq.Poller()
        for s in self.listener.sockets():
            poller.register(s, zmq.POLLIN)
        tick = max(0.01, min(0.1, self.worker_timeout / 4))
        restore = self.catch_signals()
        try:
            while not self.finished() and not self.stopping():
                for s, _ in poller.poll(tick * 1000):
                    if s is self.sock:
                        self.receive()
                    else:
                        self.listener.service(s)
                self.check_workers()
                self.trim_when_due()
        finally:
            restore()
        if self.stopping():
            self.stop(signal.Signals(self.stop_signal).name)
        self.listener.close()
        log.info("shard %d done: workers closed %s, dead %s", self.shard_id,
                 sorted(self.roster.closed), sorted(self.roster.dead))

    def receive(self, most=64):
        """Handle the messages queued now: one poll for many (at most `most`, so that
        the ZAP handler and the death check get their turn).  Frames are used in place."""
        for _ in range(most):
            frames = self.sock.recv_multipart(copy=False)      # the poll said one is there
            user = frames[1].get("User-Id").encode() if self.keys and len(frames) > 1 else None
            if user is None or self.speaks(frames[1], user):
                self.handle(frames[0].bytes, frames[1:], user)
            if not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return

    def speaks(self, frame, user):
        """Whether key `user` may speak on the connection this frame came on (auth's per-key
        cap); if not, that connection is cut and its message dropped, a refused flood."""
        refusal = self.listener.connections.speaks(frame.get(zmq.SRCFD), user)
        if refusal:
            self.listener.refusals.note("cap", refusal)
            self.trim_later()
        return refusal is None

    def trim_later(self):
        """A refused message (a flood's, perhaps) or a worker that left: trim the heap once
        TRIM_QUIET_S have passed without another such event (trim_when_due)."""
        self.trim_at = time.monotonic() + TRIM_QUIET_S

    def trim_when_due(self):
        """Memory back to the kernel: what a flood's frames held (heap.trim).  Never
        after an ordinary step, which keeps its warm pages (heap.tune)."""
        if self.trim_at is not None and time.monotonic() >= self.trim_at:
            self.trim_at = None
            heap.trim()

    def catch_signals(self):
        """SIGINT/SIGTERM end the loop at its next turn (only the main thread may catch);
        draining, the first one only counts (stopping)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        def note(signum, frame):
            self.stop_signal, self.signals = signum, self.signals + 1
            if self.signals == 1 and self.on_signal == "drain":
                log.warning("shard %d: %s: serving on until the workers have closed (they "
                            "checkpoint); a second signal stops it now", self.shard_id,
                            signal.Signals(signum).name)
        old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(s, h) for s, h in old.items()]

    def stopping(self):
        """A signal ends the loop: the first, or draining the second."""
        return self.stop_signal is not None and \
            (self.on_signal == "checkpoint" or self.signals > 1)

    def stop(self, why):
        """Stopped from outside: save what there is (draining: nothing, the workers own the
        checkpoint), tell the waiting workers."""
        path = self.checkpoint(force=True) if self.checkpoints and self.store.has_values \
            and self.on_signal == "checkpoint" else None
        log.warning("shard %d: %s: %s", self.shard_id, why,
                    f"final checkpoint {path}" if path else "nothing to checkpoint")
        self.fail(f"shard {self.shard_id} was stopped by {why}")

    def finished(self):
        return self.store.configured and self.roster.all_gone(self.store.num_workers)

    def handle(self, identity, frames, user=None):
        try:
            msg = P.decode(frames)
            if msg.op not in WORKER_OPS:
                raise P.ProtocolError(f"op {msg.op.name} is a reply, not a request")
            if msg.op == P.Op.HEARTBEAT:     # never answered: nobody reads the heartbeat socket
                return self.heartbeat(identity, user, msg.sender)
            s = self.store
            self.roster.admit(identity, user, msg.sender, msg.op,
                              s.num_workers if s.configured else MAX_WORKERS)
            self.dispatch(identity, msg)
        except (P.ProtocolError, ValueError) as e:
            self.trim_later()             # a refused message may have been a flood's
            request = P.peek_request(frames)
            log.warning("shard %d: refused a message (request %d): %s", self.shard_id, request, e)
            self.outbox.error(identity, request, str(e))
        except Exception as e:      # a bug must not take the shard down with it
            log.exception("shard %d: internal error", self.shard_id)
            self.outbox.error(identity, P.peek_request(frames),
                              f"internal error: {type(e).__name__}: {e}")

    def heartbeat(self, identity, user, w):
        if not self.store.configured:
            return
        try:
            self.roster.heartbeat(identity, user, w, self.store.num_workers)
        except ValueError as e:
            log.warning("shard %d: ignored a heartbeat for worker %d: %s", self.shard_id, w, e)

    def dispatch(self, identity, msg):
        s, w, op = self.store, msg.sender, msg.op
        if op in (P.Op.BYE, P.Op.ABORT):
            if self.roster.close(w):
                if op == P.Op.ABORT:
                    text = bytes(msg.extras[0][:P.MAX_TEXT]).decode("utf-8", "replace")
                    self.lose_worker(w, f"worker {w} exited with an error ({text})")
                else:
                    s.drop_worker(w)      # a clean finish: BSP steps no longer wait for it
                    self.release()
                self.trim_later()
            return self.outbox.send(identity, P.encode(P.Op.OK, self.shard_id, msg.request,
                                                       extras=[b"bye"]))
        if self.failure:
            raise ValueError(self.failure)
        if op == P.Op.STATS:
            return self.outbox.send(identity, P.encode(P.Op.STATS_REPLY, self.shard_id,
                                                       msg.request, extras=[s.stats()]))
        if op == P.Op.CHECKPOINT:
            path = self.checkpoint(force=True, step=requested_step(msg.extras[0]))
            return self.outbox.send(identity, P.encode(P.Op.OK, self.shard_id, msg.request,
                                                       extras=[path.encode()]))
        if op == P.Op.INIT:
            self.init(msg)
        else:
            if len({e.key for e in msg.entries}) != len(msg.entries):
                raise ValueError(f"{op.name} names a key twice")
            for e in msg.entries:
                s.check_entry(e, w, push=op != P.Op.PULL)
            if op in (P.Op.PUSH, P.Op.PUSH_PULL):
                # 16-bit gradients widened, compressed ones decoded, to float32 first: the
                # sum and the step are fp32 (protocol.to_float32)
                pushed = [(e, P.to_float32(e, frames)) for e, frames in msg.entry_frames()]
                for e, frames in pushed:
                    if not frames:
                        raise ValueError(f"key {e.key}: {op.name} without a gradient")
                    s.check_finite(e, w, frames)
                for e, frames in pushed:
                    s.push(e.key, w, e.step, frames)
                if self.checkpoints and self.checkpoints.every:   # O(keys): only if needed
                    s.note_pushes(w)
        if op == P.Op.PUSH:
            self.outbox.send(identity, P.encode(P.Op.OK, self.shard_id, msg.request,
                                                extras=[b"pushed"]))
        else:
            self.pending.append((identity, op, msg.request, w, msg.entries))
        self.checkpoint()      # before the replies: a worker that has its values can rely on it
        self.release()

    def init(self, msg):
        try:
            opt, consistency, num_workers = unpack_config(bytes(msg.extras[0]))
        except ValueError as e:
            raise ValueError(f"INIT from worker {msg.sender}: {e}") from None
        if not 0 < num_workers <= MAX_WORKERS or msg.sender >= num_workers:
            raise ValueError(f"INIT from worker {msg.sender} with W={num_workers}")
        names = bytes(msg.extras[1]).decode("utf-8", "replace").split("\n")
        if len(msg.extras[1]) > 256 * P.MAX_TEXT or len(names) != len(msg.entries):
            raise ValueError(f"INIT has {len(names)} names for {len(msg.entries)} entries")
        for e in msg.entries:
            if e.dtype != P.FLOAT32:
                raise ValueError(f"key {e.key}: dtype code {e.dtype}, servers hold float32 (code 0)")
            if e.nframes > P.most_frames(e.length):
                raise ValueError(f"key {e.key}: {e.nframes} frames for {e.length} elements, "
                                 f"at most {P.most_frames(e.length)} (protocol.most_frames)")
        group = P.group_of(msg)
        if group is not None and msg.sender not in group:
            raise ValueError(f"INIT from worker {msg.sender} for the keys of group "
                             f"{list(group)[:8]}, which it is not in")
        self.store.configure(opt, consistency, num_workers, msg.entries, names, group)
        self.roster.expect(num_workers)
        self.listener.expect_workers(num_workers)
        # the first worker of the keys' group (worker 0 of all W without one) brings
        # their initial values; the others' INITs wait for them (release)
        first = 0 if group is None else group[0]
        if msg.sender == first and not self.store.values_of(msg.entries):
            for e, frames in msg.entry_frames():
                if not frames:
                    raise ValueError(f"worker {first}'s INIT must carry the initial value "
                                     f"of every key of its group")
                self.store.check_finite(e, first, frames, "an initial value")
            self.store.set_values(msg)

    # -- replies -------------------------------------------------------------------
    def release(self):
        """Send every held-back reply the consistency model now allows."""
        s, still, unread = self.store, [], {}
        limit = self.max_unread or 2 * s.value_bytes + UNREAD_MARGIN
        for item in self.pending:
            identity, op, request, w, entries = item
            ready = s.values_of(entries) if op == P.Op.INIT else \
                all(s.may_read(e.key, w) for e in entries)
            if not ready:
                still.append(item)
            elif w not in unread:
                try:
                    self.outbox.values(identity, request, w, s.keys, entries, limit)
                except UnreadReplies as e:
                    unread[w] = str(e)
                    self.outbox.error(identity, request, str(e))
        self.pending = [item for item in still if item[3] not in unread]
        for w, why in unread.items():
            self.expel(w, why)

    # -- faults and checkpoints -----------------------------------------------------
    def check_workers(self):
        for w, why in self.roster.overdue():
            self.lose_worker(w, why)

    def expel(self, w, why):
        """Stop serving w (it does not read its replies): from now on it is dead."""
        self.roster.expel(w, why)
        self.outbox.forget(w)
        self.lose_worker(w, why)

    def lose_worker(self, w, why):
        """A worker died or crashed: fail the run (BSP/SSP, policy 'fail') or go on without it."""
        s = self.store
        self.trim_later()
        log.warning("shard %d: %s", self.shard_id, why)
        if self.on_worker_death == "fail" and s.consistency and s.consistency.mode != "asp":
            self.fail(f"{why}; shard {self.shard_id} fails the {s.consistency.mode} run "
                      f"(on_worker_death='fail')")
        else:
            s.drop_worker(w)
            self.release()

    def fail(self, text):
        """From now on every request gets `text`, the waiting ones at once."""
        self.failure = self.failure or text
        for identity, _, request, _, _ in self.pending:
            self.outbox.error(identity, request, self.failure)
        self.pending = []

    def checkpoint(self, force=False, step=None):
        """The own file when forced or due; with a step, the part of that step's set."""
        if not self.checkpoints or not self.store.has_values:
            if force:
                raise ValueError("cannot checkpoint now: no checkpoint dir or no values yet")
            return None
        path = self.checkpoints.write(self.store, force, step)
        if path:
            log.info("shard %d: checkpoint -> %s", self.shard_id, path)
        return path


def receive_hwm(step_messages):
    """The receive high-water mark of the bind: one step's messages of a worker, as the
    launcher counted them (launch.step_messages), within [RECEIVE_HWM, MOST_RECEIVE_HWM];
    RECEIVE_HWM when nobody counted them (a server started by hand)."""
    if step_messages is None:
        return RECEIVE_HWM
    return min(max(step_messages, RECEIVE_HWM), MOST_RECEIVE_HWM)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1)
    ap.add_argument("--bind", default="tcp://127.0.0.1:0", help="loopback unless told otherwise")
    ap.add_argument("--keys", help="directory from python -m psrv.keys: CURVE keypair of the "
                    "servers and the workers' public keys (required off loopback)")
    ap.add_argument("--worker-timeout", type=float, default=10.0)
    ap.add_argument("--join-timeout", type=float, default=60.0,
                    help="seconds a worker may take to send its first message")
    ap.add_argument("--on-worker-death", choices=("fail", "continue"), default="fail")
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="steps between checkpoints (steps every worker has pushed)")
    ap.add_argument("--resume", action="store_true", help="load the checkpoint if there is one")
    ap.add_argument("--max-unread-mib", type=float,
                    help="replies a worker may leave unread before the shard stops serving it "
                    "(default: twice the shard's values + 64 MiB)")
    ap.add_argument("--step-messages", type=int,
                    help="messages one worker sends this shard in a step, as the launcher "
                    "counts them from the keys (launch.step_messages): ZeroMQ queues that "
                    f"many per connection, within [{RECEIVE_HWM}, {MOST_RECEIVE_HWM}] "
                    f"(default: {RECEIVE_HWM})")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        keys = load_server_keys(a.keys) if a.keys else None
        server = Server(a.bind, a.shard, a.num_shards, a.worker_timeout, a.on_worker_death,
                        a.checkpoint_dir, a.checkpoint_every, a.resume, keys,
                        join_timeout=a.join_timeout,
                        max_unread=None if a.max_unread_mib is None else a.max_unread_mib * 2**20,
                        step_messages=a.step_messages)
    except (ValueError, zmq.ZMQError) as e:
        ap.exit(2, f"psrv.server: {e}\n")
    print(f"psrv.server shard {a.shard} listening on {server.endpoint}", flush=True)
    server.serve()


if __name__ == "__main__":
    main()
