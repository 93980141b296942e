"""Alpha-beta-gamma times of the collectives on one host: the formulas the cost model,
the simulator and `allreduce.bench --predict` share (allreduce/twolevel.py puts
them on hosts joined by links).

    m = Machine(alpha=5e-6, beta=1 / 10e9, gamma=1 / 40e9)     # s, s/byte, s/byte
    ring_allreduce(64 << 20, P=8, m)          # predicted seconds
    m = Machine.from_calibration(json.load(open("results/calibration.json")))

Hockney's model ("The communication challenge for MPP: Intel Paragon and Meiko
CS-2", Parallel Computing 1994): a message of n bytes takes alpha + n * beta;
reducing n bytes costs n * gamma.  The collective formulas are those of
Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH" (IJHPCA 2005, section 4) unless noted; every one counts
the slowest rank's critical path.  experiments/costmodel.py says how beta and
gamma are read per message size (Kielmann et al.'s parameterised LogP), one
way or exchanged, and why `cores` stretches them.

Quick reference (n bytes, P ranks, lg = ceil(log2 P)):
    ring               2(P-1) alpha + 2(P-1)/P n beta + (P-1)/P n gamma
    binomial tree      2 lg (S alpha + n beta1) + lg n gamma  (S segments of 1 MiB; beta1 one way)
    halving-doubling   2 log2 p alpha + 2(p-1)/p n beta + (p-1)/p n gamma  (+ a fold if P != p)
                       below 32 KiB: log2 p (alpha + n beta + n gamma)  (recursive doubling)
    hierarchical       ring inside k-rank nodes + ring over N nodes + broadcast inside
"""
import math
from dataclasses import dataclass

from .collective import SEGMENT_BYTES
from .halving_doubling import recursive_doubling


@dataclass(frozen=True)
class Machine:
    alpha: float                 # seconds per message
    beta: float                  # seconds per byte sent
    gamma: float = 0.0           # seconds per byte reduced
    cores: int = None            # ranks beyond this many share cores (None: one core each)
    ps_alpha: float = None       # psrv: seconds per push+pull round trip
    ps_beta: float = None        # psrv: seconds per byte each way (at >= 1 MiB; for show)
    ps_curve: tuple = None       # psrv: ((bytes, seconds), ...) of W = S = 1 push+pull
    ps_marginal: tuple = None    # psrv: ((bytes, seconds), ...) one more worker adds
    beta_curve: tuple = None     # ((message bytes, seconds per byte sent), ...)
    beta_one_way_curve: tuple = None   # the same for a message sent one way
    gamma_curve: tuple = None    # ((chunk bytes, seconds per byte reduced), ...)

    def __post_init__(self):
        if min(self.alpha, self.beta, self.gamma) < 0:
            raise ValueError(f"alpha, beta, gamma must be >= 0, got {self}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {self.cores}")
        for name in ("ps_curve", "ps_marginal", "beta_curve", "beta_one_way_curve",
                     "gamma_curve"):
            curve = getattr(self, name)
            if curve is None:
                continue
            sizes = [b for b, _ in curve]
            if not sizes or sizes != sorted(set(sizes)) or sizes[0] <= 0 or \
                    any(v < 0 for _, v in curve):
                raise ValueError(f"{name} must be ((size, value), ...) with sizes > 0 "
                                 f"increasing and values >= 0, got {curve}")

    @classmethod
    def from_calibration(cls, cal, cores=True):
        """From experiments.calibrate's JSON (or its 'calibration' record)."""
        def curve(sizes, values):
            if not cal.get(values):
                return None
            if len(cal[sizes]) != len(cal[values]):
                raise ValueError(f"calibration: {len(cal[sizes])} {sizes} but "
                                 f"{len(cal[values])} {values}")
            return tuple(zip(cal[sizes], cal[values]))
        return cls(alpha=cal["alpha_s"], beta=cal["beta_s_per_byte"],
                   gamma=cal["gamma_s_per_byte"], cores=cal.get("cores") if cores else None,
                   ps_alpha=cal.get("ps_alpha_s"), ps_beta=cal.get("ps_beta_s_per_byte"),
                   ps_curve=curve("ps_bytes", "ps_s"),
                   ps_marginal=curve("ps_bytes", "ps_marginal_s"),
                   beta_curve=curve("beta_bytes", "beta_s_per_byte_at"),
                   beta_one_way_curve=curve("beta_one_way_bytes",
                                            "beta_one_way_s_per_byte_at"),
                   gamma_curve=curve("gamma_bytes", "gamma_s_per_byte_at"))

    def beta_at(self, b):
        """Seconds per byte of a b-byte message exchanged (both peers send at once)."""
        return interpolate(self.beta_curve, b) if self.beta_curve else self.beta

    def beta_one_way_at(self, b):
        """Seconds per byte of a b-byte message sent one way (the peer sends nothing
        back meanwhile); beta_at(b) where not measured."""
        if self.beta_one_way_curve:
            return interpolate(self.beta_one_way_curve, b)
        return self.beta_at(b)

    def gamma_at(self, b):
        """Seconds per byte reduced when a step reduces a b-byte chunk."""
        return interpolate(self.gamma_curve, b) if self.gamma_curve else self.gamma

    def stretch(self, procs):
        """How much slower bandwidth terms run when `procs` processes share the cores."""
        return max(1.0, procs / self.cores) if self.cores else 1.0


def lg(P):
    return math.ceil(math.log2(P)) if P > 1 else 0


def segments(n):
    """How many segments a message of n bytes travels in (Collective.segments)."""
    return max(1, math.ceil(n / SEGMENT_BYTES))


def interpolate(curve, n):
    """The value of a measured ((size, value), ...) curve at size n: linear in
    log(value) against log(size) between measured sizes, flat past the ends.
    Where a value is 0 (a cost lost in the noise) the log does not exist, and
    the interpolation is linear in the value instead."""
    sizes, values = [b for b, _ in curve], [v for _, v in curve]
    if n <= sizes[0]:
        return values[0]
    if n >= sizes[-1]:
        return values[-1]
    i = next(i for i in range(1, len(sizes)) if n <= sizes[i])
    x = math.log(n / sizes[i - 1]) / math.log(sizes[i] / sizes[i - 1])
    a, b = values[i - 1], values[i]
    if a <= 0 or b <= 0:
        return (1 - x) * a + x * b
    return math.exp((1 - x) * math.log(a) + x * math.log(b))


# ------------------------------------------------------------------- collectives
def ring_allreduce(n, P, m):
    """Reduce-scatter then all-gather, P-1 steps each, n/P bytes per step.
    Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations" (JPDC 2009): the bandwidth term 2(P-1)/P n beta is optimal."""
    if P == 1:
        return 0.0
    chunk = n / P
    beta, gamma, s = m.beta_at(chunk), m.gamma_at(chunk), m.stretch(P)
    return 2 * (P - 1) * m.alpha + (P - 1) / P * n * (2 * beta + gamma) * s


def ring_reduce_scatter(n, P, m):
    if P == 1:
        return 0.0
    chunk = n / P
    return (P - 1) * m.alpha + (P - 1) / P * n * (m.beta_at(chunk) + m.gamma_at(chunk)) * \
        m.stretch(P)


def ring_allgather(n, P, m):
    if P == 1:
        return 0.0
    return (P - 1) * m.alpha + (P - 1) / P * n * m.beta_at(n / P) * m.stretch(P)


def tree_allreduce(n, P, m):
    """Binomial-tree reduce to rank 0, then binomial broadcast (Thakur et al. 2005,
    4.4: MPICH's short-message allreduce): lg P rounds of the whole message each
    way, so latency grows as log P but every round moves all n bytes.  tree.py
    sends a round segment by segment, each a blocking message: a latency each."""
    s = m.stretch(P)
    return 2 * lg(P) * (segments(n) * m.alpha + n * m.beta_one_way_at(n) * s) + \
        lg(P) * n * m.gamma_at(n) * s


def halving_doubling_allreduce(n, P, m):
    """Rabenseifner's algorithm (Thakur et al. 2005, 4.4): recursive-halving
    reduce-scatter then recursive-doubling all-gather over p = 2^floor(log2 P)
    ranks; the P - p extra ranks first fold their vector into a partner and get
    the result back at the end (+2 (alpha + n beta1) + n gamma, beta1 one way).
    Below RECURSIVE_DOUBLING_BELOW bytes, recursive doubling instead: lg p
    exchanges of all n bytes, each added."""
    if P == 1:
        return 0.0
    p, s = 1 << (P.bit_length() - 1), m.stretch(P)
    if recursive_doubling(n):
        t = lg(p) * (m.alpha + n * m.beta_at(n) * s + n * m.gamma_at(n) * s)
    else:
        t = 0.0
        for k in range(1, p.bit_length()):  # round k exchanges and reduces n / 2^k, twice
            b = n / 2 ** k                  # (halving on the way down, doubling back up)
            t += 2 * (m.alpha + b * m.beta_at(b) * s) + b * m.gamma_at(b) * s
    if p != P:
        t += 2 * (m.alpha + n * m.beta_one_way_at(n) * s) + n * m.gamma_at(n) * s
    return t


def hierarchical_allreduce(n, P, k, intra, inter):
    """Two levels, as allreduce/hierarchical.py does it (the scheme of Jia et al.,
    "Highly scalable deep learning training system with mixed-precision", 2018,
    and of Horovod's hierarchical allreduce): k ranks per node, N = P / k nodes.
      1. ring reduce-scatter inside the node, the leader gathers the k shards
      2. the N leaders ring-allreduce n bytes over the inter-node links
      3. the leader broadcasts inside the node: a pipelined chain of segments, which
         fills in k - 2 hops, then streams (one latency a segment, ~ n beta)
    The node's k ranks share its cores in all three steps (stretch(k), as in the ring)."""
    N, s = max(1, P // k), intra.stretch(k)
    t = ring_reduce_scatter(n, k, intra)
    if k > 1:
        t += (k - 1) * intra.alpha + (k - 1) / k * n * intra.beta_one_way_at(n / k) * s  # gather
        t += (segments(n) + k - 2) * intra.alpha + n * intra.beta_one_way_at(n) * s  # broadcast
    return t + ring_allreduce(n, N, inter)


ALLREDUCE = {"ring": ring_allreduce, "tree": tree_allreduce,
             "halving_doubling": halving_doubling_allreduce}


def allreduce_time(algo, n, P, m, ranks_per_node=None):
    """Predicted seconds of one all-reduce of n bytes; None for algorithms the model lacks."""
    if algo == "hierarchical":
        k = ranks_per_node or P
        return hierarchical_allreduce(n, P, k, m, m)
    fn = ALLREDUCE.get(algo)
    return fn(n, P, m) if fn else None
