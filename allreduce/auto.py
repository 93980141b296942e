"""auto: an algorithm per call, chosen from the message size, P and the node layout.

MPI libraries do this inside MPI_Allreduce.  MPICH takes recursive doubling
below MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE (2 KiB) and Rabenseifner's
reduce-scatter + all-gather above it (Thakur, Rabenseifner & Gropp,
"Optimization of collective communication operations in MPICH", 2005, 4.4);
Open MPI's tuned component (coll_tuned_decision_fixed.c) picks recursive
doubling, ring or segmented ring from the message size and communicator size.
Here the candidates are this package's textbook algorithms, the hierarchical
one where ranks sit on several nodes, and the library's own (`mpi`) where the
transport is MPI.  The rule is one of three (`RULES`):

  the cost model   with a calibration (create("auto", calibration="cal.json")
                   or TOPOLAB_CALIBRATION) on one host: the candidate of least
                   predicted time (allreduce/costs.py's formulas, `native_allreduce`)
  the two-level    on several hosts, with a calibration that measured the link
  cost model       between them (experiments.calibrate run across hosts writes
                   inter_*): the same, priced host by host and link by link
                   (allreduce/twolevel.py), hierarchical among the candidates
  a table          otherwise (`table_choice`), measured on a 2-core machine; also
                   on several hosts with a calibration that has no link, since
                   the one-level model would price the link as shared memory

Every rank must run the same algorithm for the same call, or they deadlock.
So a decision depends on nothing but what all ranks share (the size in bytes,
P, the node layout) and never on a local timing; and rank 0 makes the whole
table when `auto` is created, one entry per collective and power of two of
the size, and sends it to the others.  Ranks that read different calibration
files, or none, still agree, and a call costs one list lookup.

Where the ring is the choice for an all-reduce of SHM_FROM bytes or more, the
ranks sit on one host and the transport is MPI, `auto` takes `shm` instead: the
ring, plus a shared-memory path for a buffer that lives in its window
(`auto.empty(n)` makes one; any other buffer goes by the ring).  No model
prices it; the threshold is measured (docs/performance.md).

Node layout: ranks that share memory (MPI_COMM_TYPE_SHARED: `node_id`), which
are hosts, or `ranks_per_node=k` to declare nodes of k consecutive ranks, as
hierarchical.py does; declared nodes share one host, so no link is priced.
"""
import os

import numpy as np

from .buffers import nbytes
from .collective import Collective
from .costs import Machine, allreduce_time, lg
from .errors import CollectiveError
from .hierarchical import Hierarchical
from .registry import TEXTBOOK, build, make_one_level
from .transport import MPITransport
from .tree import Tree
from .twolevel import calibrated_link, cluster_allreduce_time

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
# From this size an all-reduce of a buffer in a shared-memory window beats the
# ring on one host: the shards are read from the peers' segments in place, so the
# three barriers' few microseconds are all it adds (shm.py).
SHM_FROM = 1 << 20
# The cost model's tie-break: the library first, then the ring (the fewest bytes).
TIE = 0.02
PREFERENCE = ("ring", "halving_doubling", "hierarchical", "tree")
RULES = ("table", "cost model", "two-level cost model")


class Layout:
    """How the ranks sit on nodes: each node's rank count, in rank order."""

    def __init__(self, node_sizes, consecutive=True, hosts=True):
        self.node_sizes = tuple(int(s) for s in node_sizes)
        self.consecutive = consecutive      # hierarchical needs block placement
        self.hosts = hosts                  # the nodes are hosts, not declared on one

    @classmethod
    def from_node_ids(cls, ids, hosts=True):
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
        return cls(sizes, consecutive, hosts)

    @property
    def P(self):
        return sum(self.node_sizes)

    @property
    def multi_node(self):
        """Several nodes with more than one rank somewhere: two levels to choose."""
        return len(self.node_sizes) > 1 and max(self.node_sizes) > 1 and self.consecutive

    @property
    def several_hosts(self):
        return self.hosts and len(self.node_sizes) > 1

    @property
    def ranks_per_host(self):
        """R where every host has R ranks in a block (the two-level model's
        schedules assume it), else None."""
        even = len(set(self.node_sizes)) == 1 and self.consecutive
        return self.node_sizes[0] if even and self.hosts else None

    def __repr__(self):
        return f"Layout(nodes={list(self.node_sizes)}{'' if self.hosts else ', declared'})"


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


def native_allreduce(n, P, m, alpha_exchange, hosts=1, link=None):
    """The MPI library's all-reduce of a short message: recursive doubling
    (MPICH below 2 KiB; Thakur et al. 2005, 4.4), lg P exchanges of the whole
    vector at the latency of a bare exchange (no Python around it), each
    followed by an add.  On several hosts of R ranks in blocks, lg R of the
    exchanges stay inside a host and lg(hosts) cross, each putting the vectors
    of all R ranks of a host through its link, after the link's latency.  Only
    its short-message path is modelled, and it is a candidate only below
    NATIVE_BELOW (see there)."""
    if P == 1:
        return 0.0
    R = P // hosts
    s = m.stretch(R)
    step = alpha_exchange + n * (m.beta_at(n) + m.gamma_at(n)) * s
    if hosts == 1:
        return lg(P) * step
    x = R * n
    across = alpha_exchange + link.alpha + x * link.beta_at(x) + n * m.gamma_at(n) * s
    return lg(R) * step + lg(hosts) * across


def model_rule(layout, cal):
    """Which rule decides for `layout` (RULES): the cost model on one host or declared
    nodes, the two-level one on several hosts with a link calibrated, else the table."""
    if cal is None:
        return "table"
    if not layout.several_hosts:
        return "cost model"
    if layout.ranks_per_host is not None and calibrated_link(cal) is not None:
        return "two-level cost model"
    return "table"


def model_choice(collective, size, layout, native, cal):
    """The candidate of least predicted time, for an all-reduce: by the one-level
    model on one host, by the two-level one on several (`model_rule`); the table
    for the other collectives (the model has formulas for all-reduces only)."""
    rule = model_rule(layout, cal)
    if collective != "allreduce" or layout.P == 1 or rule == "table":
        return table_choice(collective, size, layout, native)
    m = Machine.from_calibration(cal)
    alpha_exchange = cal.get("alpha_exchange_s") or m.alpha
    P = layout.P
    if rule == "cost model":
        times = {algo: allreduce_time(algo, size, P, m) for algo in TEXTBOOK}
        if layout.multi_node:
            times["hierarchical"] = allreduce_time("hierarchical", size, P, m,
                                                   ranks_per_node=max(layout.node_sizes))
        if native and size < NATIVE_BELOW:
            times[native] = native_allreduce(size, P, m, alpha_exchange)
    else:
        hosts, R, link = len(layout.node_sizes), layout.ranks_per_host, calibrated_link(cal)
        times = {algo: cluster_allreduce_time(algo, size, hosts, R, m, link) for algo in
                 TEXTBOOK + (("hierarchical",) if layout.multi_node else ())}
        if native and size < NATIVE_BELOW:
            times[native] = native_allreduce(size, P, m, alpha_exchange, hosts, link)
    # Predictions within TIE of the best are a tie (at P = 2 the ring and
    # halving-doubling are one schedule), which PREFERENCE breaks.
    best = min(times.values())
    return next(a for a in (native,) + PREFERENCE if a in times and times[a] <= best * (1 + TIE))


def read_calibration(source):
    """A calibration dict from a dict, a JSON file's path or the directory holding it
    (calibrate --out DIR), or TOPOLAB_CALIBRATION; None where there is none."""
    source = source if source is not None else os.environ.get("TOPOLAB_CALIBRATION") or None
    if source is None or isinstance(source, dict):
        return source
    from .records import read_calibration as read_file_or_directory
    try:
        return read_file_or_directory(source)
    except (OSError, ValueError) as e:
        raise CollectiveError(f"auto: cannot read the calibration {source!r}: {e}") from None


class Auto(Collective):
    name = "auto"

    def __init__(self, transport, calibration=None, ranks_per_node=None, **options):
        super().__init__(transport, **options)
        native = "mpi" if isinstance(transport, MPITransport) else None
        self.layout = self._find_layout(transport, ranks_per_node)
        shared = native is not None and len(self.layout.node_sizes) == 1 and self.size > 1
        names = TEXTBOOK + (("hierarchical",) if self.layout.multi_node else ()) + (
            (native,) if native else ()) + (("shm",) if shared else ())
        # 1. rank 0 decides every size class (and says by which rule, last entry)
        decided = np.zeros(len(COLLECTIVES) * SIZE_CLASSES + 1, dtype=np.int64)
        if self.rank == 0:
            cal = read_calibration(calibration)
            rule = model_rule(self.layout, cal)
            for i, collective in enumerate(COLLECTIVES):
                for k in range(SIZE_CLASSES):
                    # the table at the class's smallest size (exact for its power-of-two
                    # thresholds), the model at the class's geometric middle
                    if rule == "table":
                        name = table_choice(collective, (1 << k) >> 1, self.layout, native)
                    else:
                        name = model_choice(collective, int(2 ** (k - 0.5)), self.layout,
                                            native, cal)
                    if shared and name == "ring" and collective == "allreduce" and \
                            (1 << k) >> 1 >= SHM_FROM:
                        name = "shm"
                    decided[i * SIZE_CLASSES + k] = names.index(name)
            decided[-1] = RULES.index(rule)
        # 2. the others take its decisions
        self._setup._broadcast(decided, 0)
        self.rule = RULES[decided[-1]]
        built = {}
        for name in sorted({names[i] for i in decided[:-1]}):
            if name == "hierarchical":
                built[name] = build(Hierarchical, name, transport, ranks_per_node=ranks_per_node,
                                    **options)
            else:
                built[name] = make_one_level(name, transport, **options)
        self.table = [[built[names[i]] for i in decided[c * SIZE_CLASSES:(c + 1) * SIZE_CLASSES]]
                      for c in range(len(COLLECTIVES))]
        self.allreduce_by_class = self.table[0]
        self.counts_traffic = native not in built and "shm" not in built
        self.shared_memory = built.get("shm")

    def empty(self, n, dtype=np.float32):
        """A buffer for the sizes that go by `shm`: in its window, so that they take
        the shared-memory path (collective, as shm's: every rank alike); np.empty
        where `shm` is never the choice."""
        if self.shared_memory is None:
            return super().empty(n, dtype)
        return self.shared_memory.empty(n, dtype)

    def _find_layout(self, transport, ranks_per_node):
        self._setup = Tree(transport)
        if ranks_per_node is not None:
            k = int(ranks_per_node)
            if k < 1:
                raise CollectiveError(f"auto: ranks_per_node={ranks_per_node} must be >= 1")
            return Layout.from_node_ids([r // k for r in range(transport.size)], hosts=False)
        mine = transport.node_id()
        ids = np.zeros(transport.size, dtype=np.int64)
        ids[transport.rank] = mine
        self._setup._allgather(ids, [(r, r + 1) for r in range(transport.size)])
        return Layout.from_node_ids([int(i) for i in ids])

    def pick(self, collective, size):
        """The collective object that runs `collective` of `size` bytes."""
        return self.table[COLLECTIVES.index(collective)][size.bit_length()]

    def choice(self, collective, size):
        """The name of the algorithm `collective` of `size` bytes runs (e.g. 'ring')."""
        return self.pick(collective, size).name

    def _allreduce_runner(self, x, op):
        # the choice's own, kept by Collective.allreduce per (op, dtype, size):
        # a call of a size seen before costs what a call of the choice does
        return self.allreduce_by_class[nbytes(x).bit_length()]._allreduce_runner(x, op)

    def _allreduce(self, x, op):
        self.allreduce_by_class[nbytes(x).bit_length()]._allreduce(x, op)

    def _reduce_scatter(self, x, bounds, op):
        return self.pick("reduce_scatter", nbytes(x))._reduce_scatter(x, bounds, op)

    def _allgather(self, x, bounds):
        self.pick("allgather", nbytes(x))._allgather(x, bounds)

    def _broadcast(self, x, root):
        self.pick("broadcast", nbytes(x))._broadcast(x, root)
