"""The cost model on two levels: N hosts of R ranks, shared memory inside a host, a link between.

    intra = Machine.from_calibration(cal)      # inside a host: alpha, beta, gamma (costs.py)
    link = link_from_calibration(cal)          # a host's link: inter_alpha_s, inter_beta_...
                                               # (calibrated_link: None if cal has none)
    cluster_allreduce_time("ring", 16 << 20, 2, 2, intra, link)       # seconds, 2 hosts x 2 ranks
    cluster_allreduce_time("ring", 16 << 20, 2, 2, intra, link_of_rate(1.0))    # nominal 1 Gbit/s

Hockney's alpha-beta model (1994) at both levels, on the schedules of Thakur,
Rabenseifner & Gropp (IJHPCA 2005) taken step by step as our algorithms run
them (theory.allreduce_steps; ranks in blocks: host h holds ranks hR..hR+R-1).
A step's messages go at once, so a step takes the longer of its two parts:

  inside hosts   the busiest rank: L alpha + (bytes it sends or receives there)
                 beta + (bytes it adds) gamma, beta and gamma read at the step's
                 message size (Machine.beta_at for an exchange, beta_one_way_at
                 for a message sent one way) and stretched where a host's R
                 ranks outnumber its cores (Machine.stretch)
  across links   L alpha_link + x beta_link(x), x = bytes through the busiest
                 link in one direction, beta_link read at x, exchanged or one way

    T = sum over steps of max(inside, across)

L is the latencies a step pays one after another: 1, or one per 1 MiB segment
where a round goes segment by segment, each a blocking message (tree.py; the
chain broadcast inside hierarchical's nodes also fills in R - 2 hops).

Who crosses is theory.host_link_bytes' accounting message by message: only a
message between ranks on different hosts.  A host's link is full duplex: what
it sends and what it receives do not halve each other (a ring's step sends and
receives n/P at once); but it is one link: the ranks of a host that cross in
the same step share it, so their bytes add (halving-doubling's first step on 2
hosts x R ranks puts R n/2 on each link).  On the emulated cluster an exchange
still costs more per byte than one way, 5-15 % at 1-16 MiB (TCP's work on both
ends, on shared cores), so the link, like a host, has a beta for each: the
calibration measures both (experiments/calibrate_link.py).  Why a max and not
a sum: ring.py and halving_doubling.py add a segment while the next one
arrives (Collective.sendrecv_reduce), and the ranks that talk inside a host do
so while others cross, so the slower part paces the step.

With one host (N = 1) no message crosses and T is costs.py's one-level formula.
When the link is the bottleneck, T is the busiest link's bytes times beta_link
(plus alpha_link a step): what host_link_bytes counts, at the link's rate.
"""
import functools

from .costs import Machine, segments
from .halving_doubling import recursive_doubling
from .theory import allreduce_steps

# the algorithms with a textbook schedule, the ones cluster_allreduce_time predicts
ALGOS = ("ring", "tree", "halving_doubling", "hierarchical")


def link_of_rate(gbps, latency_s=0.0):
    """A host's link at its nominal rate, gbps Gbit/s each way: 8 / (gbps 1e9) s a byte."""
    return Machine(latency_s, 8 / (gbps * 1e9))


def link_from_calibration(cal):
    """A host's link as experiments/calibrate_link.py measured it: a Machine whose
    alpha and beta are the link's, beta_at(x) and beta_one_way_at(x) read at x =
    bytes through one direction of it in a step (the steps' message sizes play
    the part they play inside a host: TCP's work per byte depends on them too)."""
    def curve(key):
        values = cal.get(key)
        return tuple(zip(cal["inter_beta_bytes"], values)) if values else None
    return Machine(cal["inter_alpha_s"], cal["inter_beta_s_per_byte"],
                   beta_curve=curve("inter_beta_s_per_byte_at"),
                   beta_one_way_curve=curve("inter_beta_one_way_s_per_byte_at"))


def calibrated_link(cal):
    """The link of a calibration made across hosts (experiments.calibrate there
    writes inter_*); None for one made on one host."""
    return link_from_calibration(cal) if "inter_beta_s_per_byte" in cal else None


def profile(steps, nodes, R):
    """What the model needs of each step (theory.Step) on nodes x R ranks in blocks:
    (repeat, exchange, segmented, fill, largest message, {(bytes moved inside,
    largest message there, bytes added, largest chunk added, talks inside)} of
    its ranks, bytes through the busiest link one way)."""
    out = []
    for step in steps:
        sent, received, added, message, chunk = {}, {}, {}, {}, {}
        up, down = [0.0] * nodes, [0.0] * nodes
        for a, b, m in step.messages:
            if a // R == b // R:
                sent[a] = sent.get(a, 0.0) + m
                received[b] = received.get(b, 0.0) + m
                for r in (a, b):
                    message[r] = max(message.get(r, 0.0), m)
            else:
                up[a // R] += m
                down[b // R] += m
            if step.reduces:
                added[b] = added.get(b, 0.0) + m
                chunk[b] = max(chunk.get(b, 0.0), m)
        ranks = set(sent) | set(received) | set(added)
        terms = frozenset((max(sent.get(r, 0.0), received.get(r, 0.0)), message.get(r, 0.0),
                           added.get(r, 0.0), chunk.get(r, 0.0), r in message) for r in ranks)
        largest = max(m for _, _, m in step.messages)
        out.append((step.repeat, step.exchange, step.segmented, step.fill, largest, terms,
                    max(up + down)))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _allreduce_profile(algo, nodes, R, outer, short):
    """An algorithm's profile per byte of the vector (n = 1): the same for every n
    of one schedule (short: halving-doubling's short-message one), so the
    simulator's thousands of ranks are walked once."""
    return profile(allreduce_steps(algo, 1.0, nodes * R, R, outer, short), nodes, R)


def profile_time(steps_profile, n, R, intra, link):
    """Seconds of a profiled schedule, its bytes scaled by n: the sum over steps of
    max(inside hosts, across the busiest link) (the module's docstring)."""
    s = intra.stretch(R)
    total = 0.0
    for repeat, exchange, segmented, fill, largest, terms, link_bytes in steps_profile:
        latencies = (segments(largest * n) if segmented else 1) + fill
        inside = 0.0
        for moved, message, added, chunk, talks in terms:
            beta = intra.beta_at(message * n) if exchange else intra.beta_one_way_at(message * n)
            t = (latencies * intra.alpha if talks else 0.0) + moved * n * beta * s
            if added:
                t += added * n * intra.gamma_at(chunk * n) * s
            inside = max(inside, t)
        x = link_bytes * n
        across = latencies * link.alpha + x * (link.beta_at(x) if exchange else
                                               link.beta_one_way_at(x)) if x else 0.0
        total += repeat * max(inside, across)
    return total


def steps_time(steps, nodes, ranks_per_node, intra, link=None):
    """Predicted seconds of any schedule, a list of theory.Step with bytes in its
    messages: your own collective's, for instance."""
    _need_link(nodes, link)
    return profile_time(profile(steps, nodes, ranks_per_node), 1.0, ranks_per_node, intra, link)


def cluster_allreduce_time(algo, n, nodes, ranks_per_node, intra, link=None, outer="ring"):
    """Predicted seconds of one all-reduce of n bytes on nodes x ranks_per_node ranks;
    None for algorithms without a textbook schedule (mpi, torch)."""
    try:
        steps_profile = _allreduce_profile(algo, nodes, ranks_per_node, outer,
                                           recursive_doubling(n))
    except ValueError:
        return None
    _need_link(nodes, link)
    return profile_time(steps_profile, n, ranks_per_node, intra, link)


def _need_link(nodes, link):
    if nodes > 1 and link is None:
        raise ValueError(f"{nodes} hosts need a link between them")


def host_layout(comm):
    """(hosts, ranks per host) of an mpi4py communicator, from MPI's shared-memory
    split (one owner of node membership); ranks per host is None unless every
    host has as many ranks, in blocks (the schedules assume it).  Collective."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    size, first = node.size, node.bcast(comm.rank, root=0)     # the host's lowest rank
    node.Free()
    layout = comm.allgather((size, first))
    hosts = len({f for _, f in layout})
    blocks = all(f == (r // size) * size and s == size for r, (s, f) in enumerate(layout))
    return hosts, size if blocks else None


def predictor(path, comm, inner="ring", outer="ring", ranks_per_node=None, emulated=False):
    """predict(algo, collective, nbytes) -> the model's microseconds or None, for
    the layout of `comm` (collective: every rank calls it).  None where the model
    has no formula: the libraries' own algorithms, collectives other than
    all-reduce, hierarchical with an inner other than ring or nodes declared
    apart from the hosts (ranks_per_node), links emulated in the transport, or
    several hosts and a calibration without the link (inter_*)."""
    hosts, R = host_layout(comm)
    from .records import read_calibration
    cal = read_calibration(path)          # a file, or the directory holding calibration.json
    intra = Machine.from_calibration(cal)
    link = calibrated_link(cal)

    def predict(algo, collective, nbytes):
        if collective != "allreduce" or R is None or emulated or (hosts > 1 and link is None):
            return None
        if algo == "hierarchical" and (inner != "ring" or ranks_per_node not in (None, R)):
            return None
        t = cluster_allreduce_time(algo, nbytes, hosts, R, intra, link, outer)
        return None if t is None else t * 1e6
    return predict
