"""Extrapolate the cost model to 8..4096 ranks on a two-level cluster; find the crossovers.

    python -m experiments.simulate                            # 8 GPUs a node, NVLink + 100 Gb/s
    python -m experiments.simulate --ranks-per-node 4 --inter-gbps 25 --inter-latency-us 30 \\
        --sizes 1M,64M,1G --jsonl results/sim.jsonl
    python -m experiments.simulate --calibration results      # intra = this box's calibration
    python -m experiments.simulate --ranks-per-node 2 --calibration results/cluster-cal
        # intra and link as measured on the emulated cluster (experiments/calibrate_link.py)

It prints, per world size P (--ranks), the crossovers (each holds on every size
past it, to 4 GiB), then, per P and per size of --sizes, the ring's predicted time
and each algorithm's time divided by the ring's.

A cluster is N nodes of k ranks, ranks placed in blocks (node i holds ranks
i*k .. i*k+k-1).  Inside a node: (alpha_intra, beta_intra, gamma); between
nodes each node has one full-duplex port (alpha_inter, beta_inter), as in a
typical GPU cluster.  All-reduces take allreduce/twolevel.py's model: each
step of the algorithm's schedule costs the longer of its part inside the nodes
and its part on the busiest port, whose bytes add up over the node's ranks that
cross in that step (halving-doubling's first steps put k messages on a port,
the ring's steps one); a tree round goes segment by segment, a latency each.

  ring          2 (P-1) steps; once N > 1 each paced by the port:
                2 (P-1) (alpha_inter + n/P beta_inter)
  tree          binomial: rounds at distance 1, 2, 4, ...; those at distance >= k
                cross nodes
  halving_doubling  distance P/2 first, n/2 a rank; those at distance >= k cross,
                k ranks of a node at once: k n / 2^i through its port
  hierarchical  ring inside, ring of the node leaders, broadcast inside
  ps(S)         BytePS (Jiang et al., OSDI 2020): a node first reduces inside
                (ring reduce-scatter + gather), pushes n and pulls n through its
                port while S server machines each take N n / S:
                max(n beta_inter, N n beta_inter / S) + alpha_inter, then an
                intra-node broadcast

--calibration FILE|DIR takes the intra-node figures from a calibration, and where
it was taken on several hosts (experiments.calibrate under
`experiments.cluster run`: inter_* fields) the inter-node port's too, in place
of --inter-gbps and --inter-latency-us.
"""
import argparse
from dataclasses import dataclass

from allreduce.cli import add_output_flags, size_list
from allreduce.records import append_jsonl, read_calibration
from allreduce.units import format_size
from allreduce.twolevel import ALGOS, cluster_allreduce_time, link_from_calibration

from .costmodel import Machine, ring_reduce_scatter

RANKS = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


@dataclass(frozen=True)
class Cluster:
    ranks_per_node: int
    intra: Machine
    inter: Machine

    def __post_init__(self):
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    def layout(self, P):
        """(nodes, ranks per node) of P ranks in blocks."""
        k = min(P, self.ranks_per_node)
        return max(1, P // k), k


def allreduce(algo, n, P, c):
    """Predicted seconds of one all-reduce by `algo` (one of ALGOS) on cluster c."""
    nodes, k = c.layout(P)
    return cluster_allreduce_time(algo, n, nodes, k, c.intra, c.inter)


def ps(n, P, c, servers):
    N, k = c.layout(P)
    local = ring_reduce_scatter(n, k, c.intra) + 2 * ((k - 1) * c.intra.alpha + n * c.intra.beta) \
        if k > 1 else 0.0                              # reduce-scatter, gather, broadcast
    push_pull = c.inter.alpha + max(n * c.inter.beta, N * n * c.inter.beta / servers)
    return local + push_pull


def table(sizes, c, ranks=RANKS, servers=(1, 4, 16)):
    """Simulation records: predicted seconds for every algorithm, size and P."""
    rows = []
    for P in ranks:
        for n in sizes:
            for algo in ALGOS:
                rows.append({"kind": "simulation", "algo": algo, "P": P, "bytes": n,
                             "time_s": allreduce(algo, n, P, c)})
            for S in servers:
                rows.append({"kind": "simulation", "algo": f"ps(S={S})", "P": P, "bytes": n,
                             "time_s": ps(n, P, c, S)})
    return rows


def crossovers(c, ranks=RANKS, n_large=256 << 20):
    """Per P: the fewest servers for PS to beat the ring on a large message; the size
    up to which the tree (latency) beats the ring at every size; the size from which
    hierarchical beats the ring at every size, up to the grid's 4 GiB.  A win at a
    few sizes that does not hold on either side is no crossover, and reads "never"."""
    grid = [1 << e for e in range(10, 33)]           # 1 KiB .. 4 GiB
    out = []
    for P in ranks:
        nodes, _ = c.layout(P)
        ring_large = allreduce("ring", n_large, P, c)
        s_min = next((S for S in range(1, 4 * nodes + 1) if ps(n_large, P, c, S) < ring_large),
                     None)
        ring_at = {n: allreduce("ring", n, P, c) for n in grid}
        tree_wins = [allreduce("tree", n, P, c) < ring_at[n] for n in grid]
        hier_wins = [allreduce("hierarchical", n, P, c) < ring_at[n] for n in grid]
        out.append({"kind": "crossover", "P": P, "nodes": nodes, "ps_servers_to_beat_ring":
                    s_min, "ps_message_bytes": n_large,
                    "tree_beats_ring_up_to_bytes": won_until(grid, tree_wins),
                    "hierarchical_beats_ring_from_bytes": won_until(grid[::-1], hier_wins[::-1])})
    return out


def won_until(sizes, wins):
    """The last of `sizes` in the unbroken run of wins that starts at the first, or
    None if the first is no win."""
    last = None
    for n, won in zip(sizes, wins):
        if not won:
            break
        last = n
    return last


def ratios(rows):
    """{(P, bytes): {algo: time / the ring's time}} of table()'s records."""
    ring = {(r["P"], r["bytes"]): r["time_s"] for r in rows if r["algo"] == "ring"}
    out = {}
    for r in rows:
        out.setdefault((r["P"], r["bytes"]), {})[r["algo"]] = r["time_s"] / ring[r["P"], r["bytes"]]
    return out


def human(n):
    """A crossover's size, or "never" where there is none."""
    return "never" if n is None else format_size(n)


def cluster_from_args(a):
    """The Cluster of the flags; a calibration replaces the intra-node figures, and
    the inter-node ones where it measured a link (inter_*)."""
    intra = Machine(a.intra_latency_us * 1e-6, 1 / (a.intra_gbps * 1e9), 1 / (a.reduce_gbps * 1e9))
    inter = Machine(a.inter_latency_us * 1e-6, 8 / (a.inter_gbps * 1e9))     # Gbit/s
    if a.calibration:
        cal = read_calibration(a.calibration)
        intra = Machine.from_calibration(cal, cores=False)
        if "inter_beta_s_per_byte" in cal:
            inter = link_from_calibration(cal)
    return Cluster(a.ranks_per_node, intra, inter)


CLUSTER_FLAGS = ("ranks_per_node", "intra_gbps", "intra_latency_us", "inter_gbps",
                 "inter_latency_us", "reduce_gbps", "calibration")


def add_cluster_flags(p, ranks_flag="--ranks-per-node"):
    """The simulated cluster's flags (CLUSTER_FLAGS), here and in experiments.report,
    whose crossover figure runs this simulator with them (`cluster_argv`)."""
    p = p.add_argument_group("the simulated cluster")
    p.add_argument(ranks_flag, dest="ranks_per_node", type=int, default=8,
                   help="ranks (GPUs) a node")
    p.add_argument("--intra-gbps", type=float, default=150.0, help="GB/s per direction (NVLink)")
    p.add_argument("--intra-latency-us", type=float, default=2.0,
                   help="latency of a message inside a node")
    p.add_argument("--inter-gbps", type=float, default=100.0,
                   help="the link between hosts in Gbit/s, as the cluster's --inter-gbps")
    p.add_argument("--inter-latency-us", type=float, default=10.0,
                   help="latency of a message between nodes")
    p.add_argument("--reduce-gbps", type=float, default=500.0, help="GB/s of summing on a GPU")
    p.add_argument("--calibration", default="", metavar="FILE|DIR",
                   help="take intra-node alpha/beta/gamma from a calibration (its file, or the "
                   "directory `experiments.calibrate --out DIR` wrote), and the inter-node "
                   "link's where it has inter_* (calibrated on a cluster)")


def cluster_argv(a):
    """The cluster flags of parsed arguments `a`, as this command's argv."""
    return [arg for name in CLUSTER_FLAGS
            for arg in (f"--{name.replace('_', '-')}", str(getattr(a, name)))]


def rank_list(text):
    """argparse type of a comma list of world sizes -> [P, ...]."""
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"not a list of world sizes: {text!r}; give e.g. 4,8,16")
    return ranks


def parser():
    p = argparse.ArgumentParser(prog="python -m experiments.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_flags(p)
    p.add_argument("--sizes", type=size_list, default="64K,16M,1G",
                   help="comma list of message sizes, e.g. 64K,16M,1G: a row each per P")
    p.add_argument("--ranks", type=rank_list, default=RANKS,
                   help=f"comma list of world sizes P (default {','.join(map(str, RANKS))})")
    add_output_flags(p, out=False)
    return p


def main(argv=None):
    """Print the crossovers, then each algorithm's time against the ring's at the sizes
    asked for; returns the records (rows, crossovers), which the report reads."""
    a = parser().parse_args(argv)
    c = cluster_from_args(a)
    rows, cross = table(a.sizes, c, a.ranks), crossovers(c, a.ranks)
    print(f"{'P':>5} {'nodes':>5} {'PS servers to beat ring':>24} {'tree beats ring up to':>22} "
          f"{'hierarchical beats ring from':>29}")
    for x in cross:
        print(f"{x['P']:5d} {x['nodes']:5d} {str(x['ps_servers_to_beat_ring']):>24} "
              f"{human(x['tree_beats_ring_up_to_bytes']):>22} "
              f"{human(x['hierarchical_beats_ring_from_bytes']):>29}")
    print("(tree: at every size up to it; hierarchical: at every size from it up to 4G)")
    algos = [algo for algo in dict.fromkeys(r["algo"] for r in rows) if algo != "ring"]
    widths = [max(8, len(algo)) for algo in algos]
    print(f"\nPer size: the ring's time, and each algorithm's time divided by the ring's "
          f"(below 1: faster than the ring)\n{'P':>5} {'nodes':>5} {'size':>6} {'ring ms':>10} |"
          + "".join(f" {algo:>{w}}" for algo, w in zip(algos, widths)))
    ring_s = {(r["P"], r["bytes"]): r["time_s"] for r in rows if r["algo"] == "ring"}
    for (P, n), ratio in ratios(rows).items():
        print(f"{P:5d} {c.layout(P)[0]:5d} {format_size(n):>6} {ring_s[P, n] * 1e3:10.3f} |"
              + "".join(f" {ratio[algo]:{w}.3f}" for algo, w in zip(algos, widths)))
    if a.jsonl:
        cluster = {"ranks_per_node": c.ranks_per_node, "intra": vars(c.intra),
                   "inter": vars(c.inter)}
        append_jsonl(a.jsonl, [{**r, "cluster": cluster} for r in rows + cross])
    return rows, cross


def cli(argv=None):
    """The console script `topolab-simulate`: exit status 0 after a run."""
    main(argv)
    return 0


if __name__ == "__main__":
    main()
