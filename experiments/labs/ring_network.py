"""Lab 1's check is the ring's network: it routes every message, and reads it.

      rank 0 ──▶ ┐                  each rank is a sandboxed process (ring_sandbox.py)
      rank 1 ──▶ ├─ the check ─▶    whose t.sendrecv hands its chunk to the check; the
      rank 2 ──▶ ┘   (here)         check delivers it to the rank it names, if that is
                                    the right neighbour, and only if it holds what a
                                    ring's message can hold

The inputs are random integers (as float64, so every order of addition gives the
same bits), drawn for each run from a seed that never leaves this process, so
no rank can predict another's.  Every message is checked as it is sent:
  the route     to the right neighbour, receiving from the left one
  the size      at most a chunk, ceil(n/P) elements; the receive buffer as long
  the contents  consecutive elements j..j+m-1, every one summed over the same arc
                of ranks that ends at the sender (its own value and those of its
                left neighbours): a partial sum of the reduce-scatter, or, when
                the arc is all P ranks, a finished element of the all-gather
  the count     over the whole all-reduce, each element goes round once in each
                phase: partial sums over arcs of 1, 2, ..., P-1 ranks, once each,
                then P-1 finished copies; no rank sends more than 2(P-1) chunks
so any schedule that is a ring passes (any chunk numbering, segments of chunks,
uneven chunks up to ceil(n/P)) and nothing else does: padding (zeros, or
values that were never summed), whole vectors, a chain that starts every
element at one rank, a sum made anywhere but in the messages.

A rank that raises is shown with its traceback; one that exits is named with its
status; when every rank that has not returned waits for a message no one will
send, the check says who waits for whom at once; a rank that runs its own code
for HANG_S seconds without calling t is named with the line it is at.
"""
import collections
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from .ring_sandbox import HANG_S, PLAIN
from .ring_transport import Op, WireError, read, write

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNSHARE = ["unshare", "--mount", "--net", "--ipc", "--pid", "--fork", "--mount-proc",
           "--kill-child"]
LOAD_S = 60.0           # importing numpy on P ranks that share two busy cores
_namespaces = None


def namespaces():
    """The `unshare` prefix if this machine lets the check use it, else []."""
    global _namespaces
    if _namespaces is None:
        cmd = UNSHARE + ([] if os.geteuid() == 0 else ["--map-root-user"])
        try:
            ok = subprocess.run(cmd + ["true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        _namespaces = cmd if ok else []
    return _namespaces


def sandbox_words():
    return ("own mount, network, IPC and PID namespaces, and an audit hook" if namespaces()
            else "an audit hook (this machine allows no namespaces)")


class Rank:
    """One sandboxed rank: its process, its pipes, and threads that turn what it
    writes into events on the check's queue (and print what it prints)."""

    def __init__(self, rank, size, events, out):
        self.rank = rank
        to_rank, self._to = os.pipe()
        self._from, to_check = os.pipe()
        self._dump_r, dump_w = os.pipe()
        prefix = namespaces()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "TOPOLAB_RING_NAMESPACES": "1" if prefix else "0"}
        self.proc = subprocess.Popen(
            prefix + [sys.executable, "-E", "-s", "-m", "experiments.labs.ring_sandbox", str(rank),
                      str(size), str(to_rank), str(to_check), str(dump_w)],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, pass_fds=(to_rank, to_check, dump_w),
            start_new_session=True)
        for fd in (to_rank, to_check, dump_w):
            os.close(fd)
        self._outbox = queue.Queue()
        self.dump = []
        self.threads = [threading.Thread(target=self._reader, args=(events,), daemon=True),
                        threading.Thread(target=self._writer, daemon=True),
                        threading.Thread(target=self._printer, args=(out,), daemon=True),
                        threading.Thread(target=self._dumper, daemon=True)]
        for thread in self.threads:
            thread.start()

    def send(self, op, payload=None, **fields):
        self._outbox.put((op, payload, fields))

    def _writer(self):
        while True:
            item = self._outbox.get()
            if item is None:
                break
            try:
                write(self._to, item[0], item[1], **item[2])
            except OSError:
                break
        os.close(self._to)

    def _reader(self, events):
        try:
            while True:
                message = read(self._from)
                if message is None:
                    break
                events.put((self.rank, message))
        except WireError as e:
            events.put((self.rank, e))
        except OSError:
            pass
        events.put((self.rank, None))

    def _printer(self, out):
        for line in iter(self.proc.stdout.readline, b""):
            out.write(f"rank {self.rank}| {line.decode('utf-8', 'replace')}")
            out.flush()

    def _dumper(self):
        while True:
            data = os.read(self._dump_r, 65536)
            if not data:
                break
            self.dump.append(data.decode("utf-8", "replace"))

    def exit_status(self, wait_s=2.0):
        try:
            code = self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return None
        return (f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0
                else f"exited with status {code}")

    def stop(self):
        self._outbox.put(None)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for thread in self.threads[2:]:
            thread.join(2.0)
        for fd in (self._from, self._dump_r):
            try:
                os.close(fd)
            except OSError:
                pass


class Failed(Exception):
    """The verdict on a wrong ring: `lines`, and tracebacks to print above them."""

    def __init__(self, lines, shown=()):
        super().__init__("\n".join(lines))
        self.lines, self.shown = list(lines), list(shown)


class Contents:
    """The inputs of one all-reduce, and what each message may hold."""

    def __init__(self, P, n, rng):
        self.P, self.n = P, n
        self.x = rng.integers(1, 1 << 40, size=(P, n)).astype(np.float64)
        self.total = self.x.sum(axis=0)
        # arcs[s][k - 1]: each element summed over the k ranks s, s-1, ..., s-k+1
        self.arcs = np.empty((P, P, n))
        for s in range(P):
            self.arcs[s] = np.cumsum([self.x[(s - i) % P] for i in range(P)], axis=0)
        self.partial = np.zeros(n, np.int64)       # bit k-1: the arc of k ranks went by
        self.finished = np.zeros(n, np.int64)
        self.chunk = -(-n // P)
        self.sent = np.zeros(P, np.int64)

    def describe(self, value):
        """What an element holds, in words: which element, summed over which ranks."""
        if value == 0:
            return "0"
        for k in range(self.P, 0, -1):
            for s in range(self.P):
                hits = np.flatnonzero(self.arcs[s, k - 1] == value)
                if hits.size:
                    ranks = sorted((s - i) % self.P for i in range(k))
                    if k == self.P:
                        return f"element {hits[0]}'s complete sum"
                    return f"element {hits[0]} summed over ranks {ranks} only"
        return "a value no element sums to over any arc of ranks"

    def take(self, sender, values, call):
        """Check one message; note what it carried.  Raises Failed."""
        P, m = self.P, len(values)
        where = f"rank {sender}'s sendrecv call {call}"
        if m > self.chunk:
            raise Failed([f"{where} sends {m} elements, more than a chunk (ceil(n/P) = "
                          f"{self.chunk}): a ring passes chunks of about n/P, never whole vectors"])
        self.sent[sender] += m
        most = 2 * (P - 1) * self.chunk
        if self.sent[sender] > most:
            raise Failed([f"{where}: rank {sender} has now sent {self.sent[sender]} elements, more "
                          f"than the 2(P-1) chunks of a ring ({most}): is some data going round "
                          f"more than once, or is one rank doing more than its share?"])
        if m == 0:
            return
        found = None
        for k, j in zip(*np.nonzero(self.arcs[sender] == values[0])):
            if j + m <= self.n and np.array_equal(self.arcs[sender, k, j:j + m], values):
                found = (int(k) + 1, int(j))
                break
        if found is None:
            raise Failed([f"{where} sends {m} value(s) that are not a ring's message: "
                          + self._why_not(sender, values)])
        k, j = found
        span = slice(j, j + m)
        if k < P:
            bit = 1 << (k - 1)
            twice = np.flatnonzero(self.partial[span] & bit)
            if twice.size:
                raise Failed([f"{where} sends elements {j}..{j + m - 1} summed over {k} ranks; "
                              f"element {j + twice[0]} went by summed over {k} ranks before: a "
                              f"ring passes each partial sum on once (whole vectors going round? the "
                              f"same chunk sent twice?)"])
            self.partial[span] |= bit
        else:
            self.finished[span] += 1
            over = np.flatnonzero(self.finished[span] > P - 1)
            if over.size:
                raise Failed([f"{where} sends element {j + over[0]}'s complete sum a {P}th "
                              f"time: the all-gather passes each finished chunk to the other "
                              f"P-1 ranks, once each"])

    def _why_not(self, sender, values):
        left = (sender - 1) % self.P
        if not values.any():
            return ("they are all 0, and no element's sum is 0 (the inputs are random, positive "
                    "and new each run): padding, sent to make up a ring's bytes?")
        first = self.describe(values[0])
        if first.startswith("a value"):
            return ("element 0 of the message is not any element of the inputs summed over "
                    "ranks (inputs are random each run, and only t.sendrecv carries them): "
                    "padding, or values made up?")
        if "over ranks" in first and str(sender) not in first.split("[")[1]:
            return (f"element 0 holds {first}, without rank {sender}'s own value: a ring adds "
                    f"what arrives from the left (rank {left}) to its own before it passes it on")
        return (f"element 0 holds {first}, but the message's elements are not consecutive "
                f"elements all summed over the same ranks ending at rank {sender}")

    def finish(self):
        """After every rank returned: did each element go round a ring's way?"""
        P = self.P
        if P == 1:
            return
        full = (1 << (P - 1)) - 1
        short = np.flatnonzero(self.partial != full)
        if short.size:
            j = short[0]
            had = [k + 1 for k in range(P - 1) if self.partial[j] >> k & 1]
            raise Failed([f"element {j} went by as a partial sum over {had or 'no'} ranks; in a "
                          f"ring's reduce-scatter it goes round once, summed over 1, 2, ..., "
                          f"{P - 1} ranks"])
        short = np.flatnonzero(self.finished != P - 1)
        if short.size:
            j = short[0]
            raise Failed([f"element {j}'s complete sum was sent {self.finished[j]} times; a ring's "
                          f"all-gather sends it to the other P-1 = {P - 1} ranks"
                          + (" (no all-gather?)" if self.finished[j] == 0 else "")])


def where_is(rank, state):
    kind, call, source = state
    if kind == "waits":
        return f"waits in sendrecv call {call} for a message from rank {source}"
    if kind == "returned":
        return f"returned from its ring after {call} sendrecv call(s)"
    if call == 0:
        return "runs its own code, before its first sendrecv call"
    return f"runs its own code after sendrecv call {call}"


def one_length(ranks, events, P, n, rng, lines):
    """Run one all-reduce of n elements on `ranks` (whose messages come on `events`,
    and `lines` of the student's file for a hang's report); raises Failed if wrong."""
    c = Contents(P, n, rng)
    for r, rank in enumerate(ranks):
        rank.send(Op.INPUT, c.x[r])
    state = {r: ("runs", 0, None) for r in range(P)}
    calls, wanted = [0] * P, [0] * P
    inbox = collections.defaultdict(collections.deque)    # (from, to): [(values, call)]
    results = {}
    last = time.monotonic()

    def deliver(r):
        kind, call, source = state[r]
        if kind != "waits" or not inbox[(source, r)]:
            return
        values, their_call = inbox[(source, r)].popleft()
        if len(values) != wanted[r]:
            raise Failed([f"rank {source}'s sendrecv call {their_call} sent {len(values)} elements "
                          f"into rank {r}'s receive buffer of {wanted[r]} (its sendrecv call "
                          f"{call}): the send and receive chunk sizes differ (the chunk a rank "
                          f"sends right must be the chunk its right neighbour receives, and "
                          f"receive buffers must be sliced to it)"])
        ranks[r].send(Op.DELIVER, values, call=call)
        state[r] = ("runs", call, None)

    while len(results) < P:
        try:
            r, message = events.get(timeout=0.2)
        except queue.Empty:
            stuck(ranks, state, last, lines)
            continue
        last = time.monotonic()
        if message is None or isinstance(message, WireError):
            died(ranks, r, state, message)
        if message.op == Op.RAISED:
            raised(ranks, r, state, message, n)
        if message.op == Op.RESULT:
            results[r] = message.payload
            state[r] = ("returned", calls[r], None)
        elif message.op != Op.SENDRECV:
            died(ranks, r, state, WireError(f"a {message.op.name} message in the middle of "
                                            f"its ring"))
        else:
            calls[r] += 1
            right, left = (r + 1) % P, (r - 1) % P
            if (message.dest, message.source) != (right, left):
                raise Failed([f"rank {r}'s sendrecv call {calls[r]} sends to rank {message.dest} "
                              f"and receives from rank {message.source}; in a ring rank {r} sends "
                              f"only to its right neighbour (rank {right}) and receives only from "
                              f"its left one (rank {left})"])
            c.take(r, message.payload, calls[r])
            inbox[(r, right)].append((message.payload, calls[r]))
            state[r], wanted[r] = ("waits", calls[r], left), message.recv_count
            deliver(right)
            deliver(r)
        deadlock(state, inbox)
    left_over = [(key, q[0][1]) for key, q in inbox.items() if q]
    if left_over:
        (s, d), call = left_over[0]
        raise Failed([f"rank {s}'s sendrecv call {call} sent a message that rank {d} never "
                      f"received: rank {d} made fewer sendrecv calls than rank {s}"])
    c.finish()
    for r in range(P):
        out = results[r]
        if out.shape != (n,):
            raise Failed([f"rank {r}: returned an array of shape {out.shape}, not ({n},)"])
        bad = np.flatnonzero(out != c.total)
        if bad.size:
            i = int(bad[0])
            raise Failed([f"rank {r}: wrong elements: {bad.size}, the first at index {i}: it holds "
                          f"{c.describe(out[i])}" + hint(c.describe(out[i]), i)])


def hint(words, i):
    if "complete sum" in words:
        return ": a chunk in the wrong place"
    if "only" in words:
        return ": a missing step, a missing addition, or no all-gather?"
    return ""


def deadlock(state, inbox):
    """Every rank that has not returned waits, and nothing is on its way to it."""
    waiting = [r for r, s in state.items() if s[0] == "waits"]
    if not waiting or any(s[0] == "runs" for s in state.values()):
        return
    if any(inbox[(state[r][2], r)] for r in waiting):
        return
    lines = [f"rank {r} {where_is(r, state[r])}, which {where_is(state[r][2], state[state[r][2]])}"
             for r in waiting]
    lines.append("no message can arrive: does every rank make the same number of sendrecv "
                 "calls, each sending right and receiving from the left?")
    raise Failed(lines)


def stuck(ranks, state, last, code):
    """No rank has called t for HANG_S (and a little): name who runs what, and the
    line of the student's file each running rank is at."""
    if time.monotonic() - last < HANG_S + 1.5:
        return
    lines = []
    for r, s in state.items():
        if s[0] == "runs":
            at = student_line(ranks[r].dump, code)
            since = f"since sendrecv call {s[1]}" if s[1] else "before its first sendrecv call"
            lines.append(f"rank {r} has run its own code for {HANG_S:g} s {since}, without "
                         f"calling t (an endless loop? a wait for something only t could "
                         f"bring?)" + (f"; it is at {at}" if at else ""))
    lines += [f"rank {r} {where_is(r, s)}" for r, s in state.items() if s[0] == "waits"]
    raise Failed(lines)


def student_line(dump, code):
    """Where the student's file is in a faulthandler dump (innermost frame first):
    'line 8 (in ring_allreduce): `while r == 1:`'."""
    path, lines = code
    for line in "".join(dump).splitlines():
        m = re.match(r'\s*File "(.*)", line (\d+) in (\S+)', line)
        if m and m.group(1) == path:
            i = int(m.group(2))
            text = lines[i - 1].strip() if 0 < i <= len(lines) else ""
            return f"line {i} of your file (in {m.group(3)}): `{text}`"
    return ""


def died(ranks, r, state, error):
    if isinstance(error, WireError):
        raise Failed([f"rank {r} wrote {error} to the transport's pipe: only t.sendrecv may write "
                      f"there"])
    how = ranks[r].exit_status() or "closed its pipe to the check"
    where = where_is(r, state[r]).replace("runs its own code", "in its own code").replace(
        "waits in", "while it waited in")
    raise Failed([f"rank {r} {how} ({where}): os._exit, a crash? the other ranks were stopped"])


def raised(ranks, r, state, message, n):
    if message.dest == PLAIN:
        raise Failed([f"rank {r}, n={n}: {message.payload}"])
    text = message.payload
    last = text.strip().splitlines()[-1] if text.strip() else "an error"
    raise Failed([f"rank {r}, n={n}: your ring raised {last} (its traceback is above)"],
                 [f"rank {r}, n={n}: your ring raised\n{text}"])


def lengths(P):
    return sorted({1, max(1, P - 1), P, P + 1, 17, 1001, 12345})


def check(path, P, out=sys.stdout, sizes=None):
    """Run the ring at P ranks on every length; None if right, else Failed."""
    source = open(path, encoding="utf-8", errors="replace").read()
    where = os.path.abspath(path)
    rng = np.random.default_rng(secrets.randbits(128))
    events = queue.Queue()
    ranks = [Rank(r, P, events, out) for r in range(P)]
    for rank in ranks:
        rank.send(Op.SOURCE, where + source, recv_count=len(where))
    try:
        loaded, deadline = 0, time.monotonic() + LOAD_S
        while loaded < P:
            try:
                r, message = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise Failed([f"the ranks did not load {path} within {LOAD_S:g} s"]) from None
            if message is None or isinstance(message, WireError):
                died(ranks, r, {r: ("runs", 0, None)}, message)
            if message.op == Op.RAISED:
                raise Failed([f"cannot load {path}: {message.payload.strip().splitlines()[-1]}"],
                             [f"rank {r}: loading {path} raised\n{message.payload}"])
            if message.op == Op.LOADED and not message.call:
                raise Failed([f"{path} defines no ring_allreduce(t, x)"])
            loaded += 1
        for n in sizes or lengths(P):
            try:
                one_length(ranks, events, P, n, rng, (where, source.splitlines()))
            except Failed as failed:
                failed.lines = [line if line.startswith(("rank ", "every")) and "n=" in line
                                else f"n={n}: {line}" for line in failed.lines]
                raise
        return None
    except Failed as failed:
        return failed
    finally:
        for rank in ranks:
            rank.send(Op.QUIT)
        for rank in ranks:
            rank.stop()
