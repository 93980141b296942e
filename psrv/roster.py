"""Who is speaking to a shard, and who is still alive: the shard's roster of workers.

    speaking   a connection speaks for one worker id; with keys a worker id belongs to
               its own client key, without to the first connection that used it
               (auth.Members); heartbeats refresh a worker but claim nothing
    alive      a worker silent for longer than worker_timeout is dead; before its
               first message the limit is join_timeout, so a slow start is no death
    expelled   a worker that does not read its replies (replies.py) is dead too
    finished   a worker that said BYE or ABORT is closed; the shard is done when
               every worker is closed or dead

The server asks the roster (admit, heartbeat, overdue) and decides what a death
means for the run (server.Server.lose_worker).
"""
import time

from . import auth
from . import protocol as P

MAX_WORKERS = 4096


class Roster:
    def __init__(self, worker_timeout, join_timeout, key_owner=None):
        self.worker_timeout = worker_timeout
        self.join_timeout = max(join_timeout, worker_timeout)   # slow starters are not dead
        self.members = auth.Members(key_owner)
        self.last_seen = {}        # worker -> time of its last message
        self.joined, self.closed, self.dead = set(), set(), set()
        self.expelled = {}         # worker -> why the shard stopped serving it

    def expect(self, num_workers):
        """INIT: death detection starts now for all W workers (all should init about now)."""
        for w in range(num_workers):
            self.last_seen.setdefault(w, time.monotonic())

    def heartbeat(self, identity, user, w, num_workers):
        """Refresh w; ValueError (the caller logs it, no reply) if this connection may not."""
        if w >= num_workers or w in self.dead or w in self.closed:
            return
        if not self.members.may_beat(identity, user, w):
            return
        self.last_seen[w] = time.monotonic()
        self.joined.add(w)

    def admit(self, identity, user, w, op, num_workers):
        """ValueError naming why worker w may not send op on this connection now."""
        if w >= num_workers:
            raise ValueError(f"sender {w} is not a worker id (W={num_workers})")
        self.members.bind(identity, user, w)
        if w in self.expelled:
            raise ValueError(self.expelled[w])
        if w in self.dead:
            raise ValueError(f"worker {w} was declared dead after {self.worker_timeout} s of silence")
        if w in self.closed and op not in (P.Op.BYE, P.Op.ABORT):
            raise ValueError(f"worker {w} has closed (it said BYE or ABORT): {op.name} refused")
        self.last_seen[w] = time.monotonic()
        self.joined.add(w)

    def close(self, w):
        """w said BYE or ABORT; False if it had already."""
        if w in self.closed:
            return False
        self.closed.add(w)
        return True

    def expel(self, w, why):
        """The shard stops serving w: dead from now on, its requests refused with why."""
        self.dead.add(w)
        self.expelled[w] = why

    def overdue(self):
        """Declare dead every worker silent for too long; -> [(w, why), ...] of the new ones."""
        now, deaths = time.monotonic(), []
        for w, seen in self.last_seen.items():
            limit = self.worker_timeout if w in self.joined else self.join_timeout
            if w in self.closed or w in self.dead or now - seen <= limit:
                continue
            deaths.append((w, f"worker {w} sent nothing for {now - seen:.1f} s "
                              f"({'worker' if w in self.joined else 'join'}_timeout {limit} s)"))
        self.dead.update(w for w, _ in deaths)
        return deaths

    def all_gone(self, num_workers):
        gone = sum(1 for w in self.closed | self.dead if w < num_workers)
        return bool(self.last_seen) and gone >= num_workers
