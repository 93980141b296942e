"""The alpha-beta-gamma cost model of collectives, parameter servers, ZeRO and pipelines.

The collectives' formulas and the calibrated Machine live in allreduce/costs.py
(one host) and allreduce/twolevel.py (hosts joined by links), below their users:
`allreduce.bench --predict` needs them and must not import this package.  Those
of one host are imported here under their old names, and so are ZeRO's traffic
(allreduce/theory.py), ZeRO's memory (strategies/runtime/memory.py) and the pipeline
bubble (strategies/parallel/bubble.py), which the benchmarks read too.

    m = Machine(alpha=5e-6, beta=1 / 10e9, gamma=1 / 40e9)     # s, s/byte, s/byte
    ring_allreduce(64 << 20, P=8, m)          # predicted seconds
    m = Machine.from_calibration(read_calibration("results"))   # allreduce.records

Hockney's model (1994): a message of n bytes takes alpha + n * beta; reducing
n bytes costs n * gamma.  The formulas are those of Thakur, Rabenseifner &
Gropp, "Optimization of collective communication operations in MPICH" (IJHPCA
2005, section 4) unless noted; every one counts the slowest rank's critical path.

Where a calibration measured them, beta and gamma are functions of the message
size (the parameterised LogP of Kielmann, Bal & Verstoep, "Fast measurement of
LogP parameters for message passing platforms", IPDPS workshops 2000): work
that fits in the caches costs about half as much per byte, and each message
pays its protocol's handshake.  `m.beta_at(b)` and `m.gamma_at(b)` read the
calibrated curves (log-log interpolation, flat past their ends); without
curves they are the constants beta and gamma, as on a cluster's link.  The
formulas read them at the size of one step's message (n/P for a ring step, n
for a tree's round) and of the chunk one step reduces.  A calibration probe of
b bytes also touches about as much memory as a ring step with b-byte messages,
so both the handshakes and the working sets match.  Reading them at the whole
vector's size instead predicted the ring 10 % too fast here (median |error|
10 % against 7 %, within 15 % at 26 against 29 of 30 points).

A step that sends one way (a tree's round, a fold, a gather, a broadcast)
reads `m.beta_one_way_at(b)`, a step where every rank sends and receives at
once (a ring's, halving-doubling's) `m.beta_at(b)`.  On a cluster's
full-duplex link the two are the same, and without a one-way curve the model
takes them to be.  On one host the cores do the copying, and two copies at
once share the memory bandwidth: a one-way message cost 4-19 % less per byte
than an exchange here (1-16 MiB), so a calibration measures both.

One term is ours, for this laptop: `cores`.  When P ranks share C < P cores,
each rank gets C / P of a core for copying and adding, so the bandwidth terms
(beta, gamma) are stretched by P / C.  Leave cores=None on a cluster.

Quick reference (n bytes, P ranks, lg = ceil(log2 P)):
    ring               2(P-1) alpha + 2(P-1)/P n beta + (P-1)/P n gamma
    binomial tree      2 lg (S alpha + n beta1) + lg n gamma  (S segments of 1 MiB; beta1 one way)
    halving-doubling   2 log2 p alpha + 2(p-1)/p n beta + (p-1)/p n gamma  (+ a fold if P != p)
    hierarchical       ring inside k-rank nodes + ring over N nodes + broadcast inside
    parameter server   alpha + max(n beta_w, W n beta_s / S) per direction       (BytePS)
    psrv, one host     T1(n) + (W - 1) D(n)    (calibrated: W = 1 round trip, each further worker)
    on a cluster       cluster_collective_time: ring all-reduce, its reduce-scatter and
                       all-gather halves, the pairwise all-to-all, on N hosts x R ranks
    context parallel   ring attention (3 cp - 2) alpha + 2 (3 cp - 2) m beta, m = b T/cp C bytes;
                       Ulysses 4 all-to-alls of 3m, m, m, 3m: 4 (cp-1) alpha + 8 (cp-1)/cp m beta
                       (one layer, forward and backward; the bytes are those of
                       strategies/parallel/ring_attention.py and strategies/parallel/ulysses.py)
"""
import functools

from allreduce.costs import (Machine, allreduce_time,  # noqa: F401 (re-exported)
                             halving_doubling_allreduce, hierarchical_allreduce, interpolate,
                             lg, ring_allgather, ring_allreduce, ring_reduce_scatter,
                             tree_allreduce)
from allreduce.alltoall import uses_bruck
from allreduce.theory import Step, bytes_sent, zero_comm_bytes  # noqa: F401 (re-exported)
from allreduce.twolevel import cluster_allreduce_time, profile, profile_time
from strategies.parallel.bubble import (  # noqa: F401 (re-exported)
    activations_in_flight as pipeline_activations_in_flight, bubble_fraction)

from strategies.parallel.ring_attention import ring_bytes
from strategies.runtime.memory import zero_memory  # noqa: F401 (re-exported)


# ------------------------------------------------------------- parameter server
def ps_push_pull(n, W, S, beta_worker, beta_server, alpha=0.0, duplex=True):
    """Jiang et al., "A unified architecture for accelerating distributed DNN
    training in heterogeneous GPU/CPU clusters" (BytePS, OSDI 2020, section 3.1):
    each worker pushes n and pulls n; each of S servers receives and sends W n / S.
    The slower side sets the pace: max(n / B_worker, W n / (S B_server)) per
    direction.  With full-duplex links push and pull overlap (duplex=True);
    over loopback on one machine they share the memory bus (duplex=False: x 2)."""
    one_way = max(n * beta_worker, W * n * beta_server / S)
    return alpha + (1 if duplex else 2) * one_way


def psrv_time(n, W, S, m):
    """psrv on this machine (one host): seconds of one push+pull of n bytes per worker.

        t(n, W) = T1(n) + (W - 1) D(n)

    T1(n) is the round trip of one worker with one server (ps_alpha included)
    and D(n) what each further worker adds: the server takes the W requests of
    a step one at a time, so the server-bound term of BytePS, W n / (S B_s),
    grows by n / B_s per worker, while each worker's own share of the round
    trip runs beside the others'.  Both are read off calibrated curves, per
    size, in the manner of Kielmann et al.'s parameterised LogP: a message that
    fits in the caches costs about half as much per byte, and psrv sends a
    tensor above 4 MiB as several slices that overlap.  S does not divide D
    here: on one host the S servers share its memory bandwidth and cores
    (BytePS's S counts servers with links of their own; simulate.py uses that).
    Without a calibrated D, each worker adds a whole round trip's bytes:
    t = ps_alpha + 2 W n ps_beta."""
    if m.ps_alpha is None or not (m.ps_curve or m.ps_beta):
        return None
    one = ps_round_trip(n, m)
    if m.ps_marginal:
        extra = n * interpolate(tuple((b, t / b) for b, t in m.ps_marginal), n)
    else:
        extra = one - m.ps_alpha
    return one + (W - 1) * extra


def ps_round_trip(n, m):
    """W = S = 1 push+pull of n bytes: the calibrated curve, else ps_alpha + 2 n ps_beta.
    What the bytes cost is interpolated per byte, so it scales with n past the ends."""
    if not m.ps_curve:
        return m.ps_alpha + 2 * n * m.ps_beta
    per_byte = tuple((b, max(t - m.ps_alpha, 0.0) / b) for b, t in m.ps_curve)
    return m.ps_alpha + n * interpolate(per_byte, n)


# -------------------------------------------------------------------- pipelines
# The bubble and the activations in flight: strategies/parallel/bubble.py, re-exported above.
def pipeline_step_time(p, m, t_forward, t_backward, activation_bytes, link, v=1, chunk=None):
    """(v m + p - 1) slots of one micro-batch's forward + backward on one chunk (1/v of
    a stage: v = 1 for GPipe and 1F1B, v chunks a rank interleaved), each slot also
    sending an activation (forward) and its gradient (backward).  chunk: the share of
    the stage's work in its slowest chunk, which paces every slot (None: 1 / v, the
    even cut; uneven chunks: planner/stages.py's chunk_share)."""
    send = link.alpha + activation_bytes * link.beta if p > 1 else 0.0
    share = 1 / v if chunk is None else chunk
    return (v * m + p - 1) * ((t_forward + t_backward) * share + 2 * send)


# ---------------------------------------------------------- context parallelism
def context_parallel_time(kind, batch, seq_len, d_model, cp, m, itemsize=4):
    """Seconds one rank spends sending one layer's context-parallel traffic in a training
    step (forward and backward), none of it hidden behind attention: the upper bound
    of what the overlap leaves exposed.

    ring     the k, v message (2 blocks) cp - 1 times forward and again backward, the
             dk, dv message (2 blocks) cp times: 3 cp - 2 messages (ring_attention.py)
    ulysses  four all-to-alls (q k v packed, the output; their gradients), each the
             pairwise exchange's cp - 1 steps, or Bruck's ceil(log2 cp) for small
             blocks, as allreduce/alltoall.py picks (ulysses.py)
    The bytes are the implementations' own formulas; every message is an exchange
    (each rank sends and receives at once), so beta is read at its size (m.beta_at)."""
    if cp == 1:
        return 0.0
    block = batch * (seq_len // cp) * d_model * itemsize
    if kind == "ring":
        messages = 3 * cp - 2
        return messages * m.alpha + ring_bytes(batch, seq_len, d_model, cp, itemsize) * \
            m.beta_at(2 * block)
    if kind == "ulysses":
        # ulysses_bytes is the sum of these four all-to-alls' bytes
        return sum((lg(cp) if uses_bruck(n // cp, cp) else cp - 1) * m.alpha +
                   bytes_sent("ring", "alltoall", n, cp) * m.beta_at(n // cp)
                   for n in (3 * block, block, block, 3 * block))
    raise ValueError(f"kind must be ring or ulysses, got {kind!r}")


# ------------------------------------------------------- collectives on a cluster
def cluster_collective_time(collective, n, nodes, R, intra, link=None):
    """Seconds of one collective of n bytes a rank on `nodes` hosts of R ranks each (in
    blocks, as allreduce/twolevel.py has them), by the ring (all-reduce, reduce-scatter,
    all-gather) or the pairwise exchange (all-to-all).

    A ring all-reduce is a reduce-scatter and then an all-gather, P - 1 steps each of
    the same messages (Thakur et al. 2005, section 4.4): each half takes half its
    time (the all-gather adds nothing, a small gamma we leave in).  The all-to-all
    is allreduce/alltoall.py's pairwise exchange: P - 1 steps, at step k rank r
    sends n/P to rank r + k, the two levels priced step by step (twolevel.steps_time)."""
    if nodes * R == 1:
        return 0.0
    if collective == "allreduce":
        return cluster_allreduce_time("ring", n, nodes, R, intra, link)
    if collective in ("reduce_scatter", "allgather"):
        return cluster_allreduce_time("ring", n, nodes, R, intra, link) / 2
    if collective == "alltoall":
        if nodes > 1 and link is None:
            raise ValueError(f"{nodes} hosts need a link between them")
        return profile_time(_alltoall_profile(nodes, R), n, R, intra, link)
    raise ValueError(f"collective must be allreduce, reduce_scatter, allgather or alltoall, "
                     f"got {collective!r}")


@functools.lru_cache(maxsize=64)
def _alltoall_profile(nodes, R):
    """The pairwise exchange's steps per byte a rank sends (n = 1), walked once per layout."""
    P = nodes * R
    return profile([Step([(r, (r + k) % P, 1 / P) for r in range(P)]) for k in range(1, P)],
                   nodes, R)
