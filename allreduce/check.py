"""TOPOLAB_CHECK=1: before a collective, all ranks verify they made the same call.

Without it, ranks that disagree (one calls allreduce on 10 floats, another on
12, or one calls broadcast) either hang or silently sum garbage.  With it,
every rank sends a fixed-size signature to rank 0, rank 0 sends the table of
all signatures back, and every rank raises the same error naming the mismatch
and the ranks.  Signatures travel on their own tag and are the same size for
every collective, so the check itself cannot deadlock on a mismatch.
"""
import os

import numpy as np

from .buffers import DTYPE_NAMES, OPS, CollectiveError

CHECK_TAG = 7919
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall")
_FIELDS = 6  # collective, count, dtype, op, root, input error


def enabled():
    return os.environ.get("TOPOLAB_CHECK", "0") not in ("", "0", "false", "no")


def signature(collective, count, dtype_code, op=None, root=-1, bad_input=False):
    return np.array([COLLECTIVES.index(collective), count, dtype_code,
                     OPS.index(op) if op in OPS else -1, root, int(bad_input)], dtype=np.int64)


def describe(sig):
    coll, count, dtype, op, root, bad = (int(v) for v in sig)
    args = [f"count={count}" if count >= 0 else "count=exchanged",
            DTYPE_NAMES[dtype] if 0 <= dtype < len(DTYPE_NAMES) else "bad dtype"]
    if op >= 0:
        args.append(f"op={OPS[op]}")
    if root >= 0:
        args.append(f"root={root}")
    text = f"{COLLECTIVES[coll]}({', '.join(args)})"
    return text + " with invalid input" if bad else text


def exchange(transport, sig):
    """Every rank's signature, as a (size, _FIELDS) table, on every rank."""
    t = transport
    table = np.zeros((t.size, _FIELDS), dtype=np.int64)
    if t.rank == 0:
        table[0] = sig
        t.wait_all([t.irecv(table[r], r, CHECK_TAG) for r in range(1, t.size)])
        t.wait_all([t.isend(table, r, CHECK_TAG) for r in range(1, t.size)])
    else:
        t.send(sig, 0, CHECK_TAG)
        t.recv(table, 0, CHECK_TAG)
    return table


def verify(transport, sig, algorithm, local_error=None):
    """Raise CollectiveError on every rank if the ranks' signatures differ."""
    table = exchange(transport, sig)
    bad = [r for r in range(len(table)) if table[r][5]]
    if bad:
        ranks = ", ".join(str(transport.world_rank(r)) for r in bad)
        mine = f": {local_error}" if local_error else ""
        raise CollectiveError(f"{algorithm}: invalid input on rank(s) {ranks}{mine}")
    if (table == table[0]).all():
        return
    groups = {}
    for r, row in enumerate(table):
        groups.setdefault(describe(row), []).append(transport.world_rank(r))
    detail = "; ".join(f"rank(s) {', '.join(map(str, ranks))} called {call}"
                       for call, ranks in groups.items())
    raise CollectiveError(f"{algorithm}: ranks disagree on the collective: {detail}")
