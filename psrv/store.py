"""What one server shard holds, and the consistency rules that decide when it answers.

Per key (one slice of one parameter) the shard keeps

    value, optimizer state      float32 arrays of the slice's length
    version                     updates applied so far
    workers                     who pushes it: its group (None: all W workers)
    clock[w]                    pushes worker w made to this key (its next step)
    read[w]                     the version last sent to worker w
    acc, arrived                BSP only: sum of this step's gradients, who sent them

Per-worker fields are dicts filled when a worker first touches the key (absent
means 0, or -1 for staleness), so an INIT costs a bounded amount per key
whatever W it declares, and W x keys is capped (MAX_KEY_WORKERS).

and the three consistency models reduce to one question each:

    on a push          bsp: add to acc; when every live worker of the key's group has
                       pushed, apply acc / n
                       ssp, asp: apply grad / G at once (G: the group's size)
    which push?        the worker's next step: step == clock[w]; under bsp also only
                       while that step is open (step == version): an early push for
                       step t+1 is refused, it would be summed into step t
    may w read key?    bsp: version >= clock[w]           (its own step is applied)
                       ssp: min_j clock[j] >= clock[w] - s (nobody of the group is more
                                                            than s behind)
                       asp: always

A key's group is the set of workers that push it.  Plain data parallelism has one
group, all W workers.  Under a pipeline or tensor split each stage or tp rank holds
other parameters, so its data-parallel replicas are the group of its keys (BytePS's
per-partition pushes, Jiang et al., OSDI 2020): every worker declares its own keys,
with its group, and the first worker of a group brings their initial values.

The staleness of an applied update is version - read[w]: how many updates the
key took between the read the gradient was computed from and this update
(always 0 under BSP).  Every value is counted in `histogram`.

Checkpoints are one .npz per shard and file (checkpoints.py names the files; arrays
only, loaded with allow_pickle=False),
written to a temporary name and renamed, so a crash leaves the old file or the
new one, never half of one.  A BSP step that is half pushed is saved as not
pushed (the clocks of the workers that pushed it are saved one lower), so after
a resume every worker pushes it again.  A resumed shard treats a push for a
step below the saved clock as already applied: it is acknowledged and skipped,
exactly once, which is what lets workers resume from the lowest clock of all
keys when shards (or keys of one shard) were saved at different steps, as
SSP and ASP do.
"""
import json
import os
from collections import Counter

import numpy as np

from . import optim
from .config import Consistency, OptimizerConfig
from .protocol import PUSH_DTYPES, most_frames

MAX_KEY_WORKERS = 1 << 24        # keys x W of one shard: per-worker state is lazy, but bounded


class Key:
    __slots__ = ("name", "offset", "length", "shape", "workers", "value", "state", "version",
                 "clock", "read", "staleness", "resumed", "acc", "arrived", "trackers")

    def __init__(self, name, offset, length, shape, workers=None):
        self.name, self.offset, self.length, self.shape = name, offset, length, tuple(shape)
        self.workers = None if workers is None else frozenset(workers)   # None: all W
        self.value = None
        self.state = {}
        self.version = 0
        self.clock = {}                          # w -> pushes (absent: 0)
        self.read = {}                           # w -> version last sent (absent: 0)
        self.staleness = {}                      # of each worker's last applied update
        self.resumed = {}                        # w -> clock loaded from a checkpoint
        self.acc = None
        self.arrived = set()
        self.trackers = []                       # zmq sends that still reference value

    def describe(self):
        return f"{self.name}[{self.offset}:{self.offset + self.length}] of shape {self.shape}"

    def writable(self):
        """Copy-on-write: a zero-copy reply still queued in ZeroMQ must not see the update."""
        if any(not t.done for t in self.trackers):
            self.value = self.value.copy()
        self.trackers = []
        return self.value


class Shard:
    def __init__(self, shard_id):
        self.shard_id = shard_id
        self.keys = {}
        self.opt = self.consistency = None
        self.num_workers = 0
        self.value_bytes = 0       # of all keys' values (float32)
        self.active = set()
        self.histogram = Counter()
        self.max_clock_gap = 0
        self.completed = {}        # w -> lowest clock of w over this shard's keys
        self.scratch = np.empty(0, np.float32)     # grad / W of one frame (ssp, asp)

    @property
    def configured(self):
        return self.opt is not None

    @property
    def has_values(self):
        return bool(self.keys) and all(k.value is not None for k in self.keys.values())

    # -- initialisation ------------------------------------------------------
    def configure(self, opt, consistency, num_workers, entries, names, group=None):
        """An INIT's keys.  Without a group every worker declares every key, the same
        ones; with one (a tuple of worker ids) the keys are that group's, and each
        group adds its own keys to the shard, declared alike by all its members."""
        if group is not None and (max(group) >= num_workers):
            raise ValueError(f"INIT's group {list(group)[:8]} names a worker id >= W={num_workers}")
        keys = len(self.keys) + sum(e.key not in self.keys for e in entries)  # after it
        if num_workers * keys > MAX_KEY_WORKERS:
            raise ValueError(f"INIT brings the shard to {keys} keys x W={num_workers} = "
                             f"{num_workers * keys} key-worker pairs on shard "
                             f"{self.shard_id}, above the limit {MAX_KEY_WORKERS}")
        if self.configured:
            mine = (self.opt, self.consistency, self.num_workers)
            if mine != (opt, consistency, num_workers):
                raise ValueError(f"INIT config {opt}, {consistency}, W={num_workers} differs "
                                 f"from the one this shard holds: {mine[0]}, {mine[1]}, "
                                 f"W={mine[2]}")
        workers = None if group is None else frozenset(group)
        declared = {e.key: (n, e.offset, e.length, e.shape, workers)
                    for e, n in zip(entries, names)}
        held = {k: (v.name, v.offset, v.length, v.shape, v.workers) for k, v in self.keys.items()
                if group is None or k in declared or v.workers == workers}
        if self.configured and held and declared != held:
            diff = sorted(set(declared.items()) ^ set(held.items()), key=str)[:3]
            raise ValueError(f"INIT declares other keys than this shard holds, e.g. {diff}")
        if not self.configured:
            self.opt, self.consistency, self.num_workers = opt, consistency, num_workers
            self.active = set(range(num_workers))
        for e, name in zip(entries, names):
            if e.key not in self.keys:
                self.keys[e.key] = Key(name, e.offset, e.length, e.shape, workers)
        self.value_bytes = 4 * sum(k.length for k in self.keys.values())

    def group(self, k):
        """The live workers whose pushes key k waits for."""
        return self.active if k.workers is None else self.active & k.workers

    def group_size(self, k):
        """Its declared workers, live or not: what SSP/ASP divide a gradient by."""
        return self.num_workers if k.workers is None else len(k.workers)

    def pushes(self, k, worker):
        return k.workers is None or worker in k.workers

    def values_of(self, entries):
        """Whether every key of these entries has its initial value."""
        return all(self.keys[e.key].value is not None for e in entries)

    def set_values(self, msg):
        """The initial values an INIT carries, for keys that have none yet."""
        for e, frames in msg.entry_frames():
            k = self.keys[e.key]
            if k.value is not None or not frames:
                continue
            k.value = np.empty(k.length, np.float32)
            pos = 0
            for f in frames:
                a = np.frombuffer(f, np.float32)
                k.value[pos:pos + len(a)] = a
                pos += len(a)
            k.state = optim.new_state(self.opt, k.length)

    def check_entry(self, e, worker, push):
        """Raise ValueError naming the problem if entry e cannot apply to this shard."""
        k = self.keys.get(e.key)
        if k is None:
            raise ValueError(f"unknown key {e.key} (this shard holds {len(self.keys)} keys)")
        if (e.offset, e.length, e.shape) != (k.offset, k.length, k.shape):
            raise ValueError(f"key {e.key} is {k.describe()}, message says "
                             f"[{e.offset}:{e.offset + e.length}] of shape {e.shape}")
        if e.nframes > most_frames(e.length, e.dtype, e.param):
            raise ValueError(f"key {e.key}: {e.nframes} frames for {e.length} elements, at "
                             f"most {most_frames(e.length, e.dtype, e.param)} (protocol.most_frames)")
        if not push:
            if e.dtype != 0:
                raise ValueError(f"key {e.key}: dtype code {e.dtype}, servers hold float32 "
                                 f"(code 0)")
            return
        if e.dtype not in PUSH_DTYPES:
            raise ValueError(f"key {e.key}: a gradient of dtype code {e.dtype}; pushes carry "
                             f"dtype codes {', '.join(map(str, PUSH_DTYPES))} (protocol.py)")
        if not self.pushes(k, worker):
            raise ValueError(f"key {e.key} ({k.name}) is pushed by workers "
                             f"{sorted(k.workers)[:8]}, not by worker {worker}")
        clock = k.clock.get(worker, 0)
        if e.step < k.resumed.get(worker, 0):
            return                                    # applied before the checkpoint: skipped
        if e.step != clock:
            raise ValueError(f"key {e.key}: worker {worker} pushed step {e.step}, "
                             f"its next step is {clock}")
        if self.consistency.mode == "bsp" and worker in k.arrived:
            waiting = sorted(self.group(k) - k.arrived)
            raise ValueError(f"key {e.key}: worker {worker} pushed step {e.step} while step "
                             f"{k.version} is still open (waiting for workers {waiting}); "
                             f"under bsp push step t+1 only after step t's values came back")

    def check_finite(self, e, worker, frames, what="a gradient"):
        """ValueError naming worker and key if frames hold a NaN or an infinity: one
        would spread through the optimizer into every later value, on every worker.
        A frame's dot product with itself is finite only where every value is (an inf
        squares to inf, a NaN spreads) and reads the frame once, without the boolean
        array isfinite writes; finite values whose squares overflow go to the exact test."""
        with np.errstate(over="ignore", invalid="ignore"):
            bad = any(not np.isfinite(np.dot(g, g)) and not np.isfinite(g).all()
                      for g in (np.frombuffer(f, np.float32) for f in frames))
        if bad:
            raise ValueError(f"worker {worker} sent {what} with NaN or inf for key {e.key} "
                             f"({self.keys[e.key].describe()}): refused, nothing applied")

    # -- pushes ----------------------------------------------------------------
    def push(self, key, worker, step, frames):
        """Record worker's gradient for key; apply it if the consistency model says so."""
        k = self.keys[key]
        if step < k.clock.get(worker, 0):            # check_entry: applied before a resume
            return
        k.clock[worker] = step + 1
        if self.consistency.mode != "bsp":
            self._apply(k, frames, 1.0 / self.group_size(k), [worker])
            return
        if not k.arrived and self.group(k) == {worker}:    # one worker: no sum, no copy
            k.arrived.add(worker)
            self._apply(k, frames, 1.0, [worker])
            return
        if k.acc is None:
            k.acc = np.empty(k.length, np.float32)
        pos = 0
        for f in frames:
            g = np.frombuffer(f, np.float32)
            if k.arrived:
                k.acc[pos:pos + len(g)] += g
            else:
                k.acc[pos:pos + len(g)] = g
            pos += len(g)
        k.arrived.add(worker)
        self.try_complete(k)

    def try_complete(self, k):
        """BSP: apply the step once every live worker of its group has pushed."""
        if k.arrived and k.arrived >= self.group(k):
            n = len(k.arrived)
            if n > 1:
                k.acc /= np.float32(n)
            self._apply(k, [k.acc], 1.0, sorted(k.arrived))

    def _apply(self, k, frames, scale, workers):
        for w in workers:
            k.staleness[w] = k.version - k.read.get(w, 0)
            self.histogram[k.staleness[w]] += 1
        value = k.writable()
        t = k.version + 1
        pos = 0
        for f in frames:
            g = np.frombuffer(f, np.float32)      # the received frame, read in place
            if scale != 1.0:                      # into a reused buffer, not a new array
                g = np.multiply(g, np.float32(scale), out=self._scaled(len(g)))
            sl = slice(pos, pos + len(g))
            optim.apply(self.opt, t, value[sl], g, {n: s[sl] for n, s in k.state.items()})
            pos += len(g)
        k.version = t
        k.arrived = set()

    def _scaled(self, n):
        if len(self.scratch) < n:
            self.scratch = np.empty(n, np.float32)
        return self.scratch[:n]

    # -- reads -----------------------------------------------------------------
    def may_read(self, key, worker):
        k = self.keys[key]
        mode = self.consistency.mode
        if mode == "bsp":
            return k.version >= k.clock.get(worker, 0)
        live = self.group(k)
        if mode == "ssp" and live:
            gap = k.clock.get(worker, 0) - min(k.clock.get(j, 0) for j in live)
            if gap > self.consistency.staleness:
                return False
            self.max_clock_gap = max(self.max_clock_gap, gap)
        return True

    def drop_worker(self, worker):
        """A dead worker stops counting (on_worker_death='continue')."""
        self.active.discard(worker)
        if self.consistency and self.consistency.mode == "bsp":
            for k in self.keys.values():
                self.try_complete(k)

    def note_pushes(self, worker):
        """After a push message of worker: its lowest clock over the keys, O(keys)."""
        self.completed[worker] = min((k.clock.get(worker, 0) for k in self.keys.values()
                                      if self.pushes(k, worker)), default=0)

    def steps_done(self):
        """Steps every live worker has pushed to every key here (BSP: the version)."""
        return min((self.completed.get(w, 0) for w in self.active),
                   default=min(self.completed.values(), default=0))

    def stats(self):
        """int64 array [max_clock_gap, n, s_1, c_1, ..., s_n, c_n] (the STATS_REPLY frame)."""
        pairs = sorted(self.histogram.items())
        return np.array([self.max_clock_gap, len(pairs)] + [x for p in pairs for x in p], np.int64)

    # -- checkpoints -----------------------------------------------------------
    def off_step(self, step):
        """Why the shard is not exactly at `step` (as text), or None: every live worker
        has pushed `step` steps to every key (a half-pushed BSP step counts as not
        pushed, as save writes it).  A checkpoint set must be of one step."""
        for key, k in self.keys.items():
            for w in sorted(self.group(k)):
                clock = k.clock.get(w, 0) - (w in k.arrived)
                if clock != step:
                    return f"worker {w} is at step {clock} on key {key} ({k.name})"
        return None

    def save(self, path):
        def clocks(k):        # a half-pushed BSP step is saved as not pushed
            return {str(w): c - (w in k.arrived) for w, c in k.clock.items()}
        meta = {"shard": self.shard_id, "num_workers": self.num_workers,
                "opt": {**vars(self.opt), "betas": list(self.opt.betas)},
                "consistency": vars(self.consistency),
                "keys": {str(key): {"name": k.name, "offset": k.offset, "length": k.length,
                                    "shape": list(k.shape), "version": k.version,
                                    "workers": None if k.workers is None else sorted(k.workers),
                                    "clock": clocks(k),
                                    "read": {str(w): v for w, v in k.read.items()}}
                         for key, k in self.keys.items()},
                "histogram": sorted(self.histogram.items())}
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
        for key, k in self.keys.items():
            arrays[f"value_{key}"] = k.value
            arrays.update({f"{n}_{key}": s for n, s in k.state.items()})
        tmp = f"{path}.tmp{os.getpid()}"
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)          # atomic on POSIX: readers see old or new

    def load(self, path):
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            opt = meta["opt"]
            self.opt = OptimizerConfig(**{**opt, "betas": tuple(opt["betas"])})
            self.consistency = Consistency(**meta["consistency"])
            self.num_workers = meta["num_workers"]
            self.active = set(range(self.num_workers))
            self.histogram = Counter({s: c for s, c in meta["histogram"]})
            for key, d in meta["keys"].items():
                k = Key(d["name"], d["offset"], d["length"], d["shape"], d.get("workers"))
                k.version, k.clock, k.read = d["version"], _per_worker(d["clock"]), _per_worker(d["read"])
                k.resumed = dict(k.clock)
                k.value = z[f"value_{key}"].astype(np.float32)
                k.state = {n: z[f"{n}_{key}"].astype(np.float32)
                           for n in optim.new_state(self.opt, 0)}
                self.keys[int(key)] = k
        self.value_bytes = 4 * sum(k.length for k in self.keys.values())
        for w in {w for k in self.keys.values() for w in k.clock}:
            self.note_pushes(w)


def _per_worker(saved):
    """{"w": n} (or the older [n, ...] list) -> {w: n}."""
    items = enumerate(saved) if isinstance(saved, list) else ((int(w), n) for w, n in saved.items())
    return {w: int(n) for w, n in items if n}
