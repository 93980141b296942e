"""auto: an algorithm per call, chosen from the message size, P and the node layout.

MPI libraries do this inside MPI_Allreduce.  MPICH takes recursive doubling
below MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE (2 KiB) and Rabenseifner's
reduce-scatter + all-gather above it (Thakur, Rabenseifner & Gropp,
"Optimization of collective communication operations in MPICH", 2005, 4.4);
Open MPI's tuned component (coll_tuned_decision_fixed.c) picks recursive
doubling, ring or segmented ring from the message size and communicator size.
Here the candidates are this package's textbook algorithms, the hierarchical
one where ranks sit on several nodes, and the library's own (`mpi`) where the
transport is MPI.  The rule is one of two:

  the cost model   with a calibration (create("auto", calibration="cal.json")
                   or TOPOLAB_CALIBRATION): the candidate of least predicted
                   time (allreduce/costs.py's formulas, `native_allreduce` below)
  a table          otherwise (`table_choice`), measured on a 2-core machine

Every rank must run the same algorithm for the same call, or they deadlock.
So a decision depends on nothing but what all ranks share (the size in bytes,
P, the node layout) and never on a local timing; and rank 0 makes the whole
table when `auto` is created, one entry per collective and power of two of
the size, and sends it to the others.  Ranks that read different calibration
files, or none, still agree, and a call costs one list lookup.

Node layout: ranks that share memory (MPI_COMM_TYPE_SHARED: `node_id`), or
`ranks_per_node=k` to declare nodes of k consecutive ranks, as hierarchical.py.
"""
import json
import os

import numpy as np

from .buffers import CollectiveError, nbytes
from .collective import Collective
from .transport import MPITransport

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
# Size class k holds the sizes [2^(k-1), 2^k) bytes (class 0: empty): a size's
# bit_length, which is below 64 for any buffer a machine can hold.
SIZE_CLASSES = 64

# The table's thresholds, powers of two so that each falls between two classes.
# Below this the library's own collective wins here: a step of ours costs
# a few us of Python on top of MPI's.  Above it MPICH allocates and touches a
# temporary on every call, whose page faults cost it more than our reused
# scratch (buffers.Scratch): 1.5 ms against the ring's 0.4 ms at 256 KiB.
NATIVE_BELOW = 128 << 10
# Below this, fewer steps beat fewer bytes: 2 log2 P exchanges (halving-doubling)
# against 2 (P-1) (ring).
LATENCY_BELOW = 1 << 20
# From this size across several nodes, crossing the slow links once per node
# (hierarchical) beats crossing them once per rank.
HIERARCHICAL_FROM = 1 << 20
# The cost model's tie-break: the library first, then the ring (the fewest bytes).
TIE = 0.02
PREFERENCE = ("ring", "halving_doubling", "hierarchical", "tree")


class Layout:
    """How the ranks sit on nodes: each node's rank count, in rank order."""

    def __init__(self, node_sizes, consecutive=True):
        self.node_sizes = tuple(int(s) for s in node_sizes)
        self.consecutive = consecutive      # hierarchical needs block placement

    @classmethod
    def from_node_ids(cls, ids):
        """From every rank's node id (equal on ranks of one node), in rank order."""
        sizes, seen = [], []
        consecutive = True
        for i, node in enumerate(ids):
            if seen and node == seen[-1]:
                sizes[-1] += 1
                continue
            consecutive &= node not in seen
            seen.append(node)
            sizes.append(1)
        return cls(sizes, consecutive)

    @property
    def P(self):
        return sum(self.node_sizes)

    @property
    def multi_node(self):
        """Several nodes with more than one rank somewhere: two levels to choose."""
        return len(self.node_sizes) > 1 and max(self.node_sizes) > 1 and self.consecutive

    def __repr__(self):
        return f"Layout(nodes={list(self.node_sizes)})"


def table_choice(collective, size, layout, native):
    """The built-in rule: the algorithm for `size` bytes.  `native` is the
    library's collective ('mpi') or None.  After MPICH's and Open MPI's fixed
    decision rules: latency-bound sizes to the fewest steps, bandwidth-bound
    ones to the ring; the numbers are this machine's (docs/performance.md)."""
    P = layout.P
    if P == 1:
        return native or "ring"        # nothing moves; the cheapest call
    if native and size < NATIVE_BELOW:
        return native
    if collective == "allreduce":
        if layout.multi_node and size >= HIERARCHICAL_FROM:
            return "hierarchical"
        if size < LATENCY_BELOW:
            return "halving_doubling"
        return "ring"
    if collective == "broadcast":
        return "tree" if size < LATENCY_BELOW else "ring"
    return "ring"                      # reduce-scatter, all-gather: bandwidth-optimal


def native_allreduce(n, P, m, alpha_exchange):
    """The MPI library's all-reduce of a short message: recursive doubling
    (MPICH below 2 KiB; Thakur et al. 2005, 4.4), lg P exchanges of the whole
    vector at the latency of a bare exchange (no Python around it), each
    followed by an add.  Only its short-message path is modelled, and it is a
    candidate only below NATIVE_BELOW (see there)."""
    from .costs import lg
    s = m.stretch(P)
    return lg(P) * (alpha_exchange + n * (m.beta_at(n) + m.gamma_at(n)) * s) if P > 1 else 0.0


def model_choice(collective, size, layout, native, cal):
    """The candidate of least predicted time, for an all-reduce; the table for
    the other collectives (the model has formulas for all-reduces only)."""
    if collective != "allreduce" or layout.P == 1:
        return table_choice(collective, size, layout, native)
    from .costs import Machine, allreduce_time
    m = Machine.from_calibration(cal)
    P = layout.P
    times = {algo: allreduce_time(algo, size, P, m) for algo in
             ("ring", "tree", "halving_doubling")}
    if layout.multi_node:
        times["hierarchical"] = allreduce_time("hierarchical", size, P, m,
                                               ranks_per_node=max(layout.node_sizes))
    if native and size < NATIVE_BELOW:
        times[native] = native_allreduce(size, P, m, cal.get("alpha_exchange_s") or m.alpha)
    # Predictions within TIE of the best are a tie (at P = 2 the ring and
    # halving-doubling are one schedule), which PREFERENCE breaks.
    best = min(times.values())
    return next(a for a in (native,) + PREFERENCE if a in times and times[a] <= best * (1 + TIE))


def read_calibration(source):
    """A calibration dict from a dict, a JSON file's path, or TOPOLAB_CALIBRATION; None
    where there is none."""
    source = source if source is not None else os.environ.get("TOPOLAB_CALIBRATION") or None
    if source is None or isinstance(source, dict):
        return source
    try:
        with open(source) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CollectiveError(f"auto: cannot read the calibration {source!r}: {e}") from None


class Auto(Collective):
    name = "auto"

    def __init__(self, transport, calibration=None, ranks_per_node=None, **options):
        from . import TEXTBOOK, make
        super().__init__(transport, **options)
        native = "mpi" if isinstance(transport, MPITransport) else None
        self.layout = self._find_layout(transport, ranks_per_node)
        names = TEXTBOOK + (("hierarchical",) if self.layout.multi_node else ()) + (
            (native,) if native else ())
        # 1. rank 0 decides every size class (and says by which rule, last entry)
        decided = np.zeros(len(COLLECTIVES) * SIZE_CLASSES + 1, dtype=np.int64)
        if self.rank == 0:
            cal = read_calibration(calibration)
            for i, collective in enumerate(COLLECTIVES):
                for k in range(SIZE_CLASSES):
                    # the table at the class's smallest size (exact for its power-of-two
                    # thresholds), the model at the class's geometric middle
                    if cal is None:
                        name = table_choice(collective, (1 << k) >> 1, self.layout, native)
                    else:
                        name = model_choice(collective, int(2 ** (k - 0.5)), self.layout,
                                            native, cal)
                    decided[i * SIZE_CLASSES + k] = names.index(name)
            decided[-1] = cal is not None
        # 2. the others take its decisions
        self._setup._broadcast(decided, 0)
        self.rule = "cost model" if decided[-1] else "table"
        built = {}
        for name in sorted({names[i] for i in decided[:-1]}):
            extra = {"ranks_per_node": ranks_per_node} if name == "hierarchical" else {}
            built[name] = make(name, transport, **options, **extra)
        self.table = [[built[names[i]] for i in decided[c * SIZE_CLASSES:(c + 1) * SIZE_CLASSES]]
                      for c in range(len(COLLECTIVES))]
        self.allreduce_by_class = self.table[0]
        self.counts_traffic = native not in built

    def _find_layout(self, transport, ranks_per_node):
        from .tree import Tree
        self._setup = Tree(transport)
        if ranks_per_node is not None:
            k = int(ranks_per_node)
            if k < 1:
                raise CollectiveError(f"auto: ranks_per_node={ranks_per_node} must be >= 1")
            ids = [r // k for r in range(transport.size)]
        else:
            mine = transport.node_id()
            ids = np.zeros(transport.size, dtype=np.int64)
            ids[transport.rank] = mine
            self._setup._allgather(ids, [(r, r + 1) for r in range(transport.size)])
            ids = [int(i) for i in ids]
        return Layout.from_node_ids(ids)

    def pick(self, collective, size):
        """The collective object that runs `collective` of `size` bytes."""
        return self.table[COLLECTIVES.index(collective)][size.bit_length()]

    def choice(self, collective, size):
        """The name of the algorithm `collective` of `size` bytes runs (e.g. 'ring')."""
        return self.pick(collective, size).name

    def _allreduce(self, x, op):
        self.allreduce_by_class[nbytes(x).bit_length()]._allreduce(x, op)

    def _reduce_scatter(self, x, bounds, op):
        return self.pick("reduce_scatter", nbytes(x))._reduce_scatter(x, bounds, op)

    def _allgather(self, x, bounds):
        self.pick("allgather", nbytes(x))._allgather(x, bounds)

    def _broadcast(self, x, root):
        self.pick("broadcast", nbytes(x))._broadcast(x, root)
