"""The points that ran on a cluster, for the report: one busbw figure per cluster
setting, the bytes on each host's link beside theory, training per setting.

    records = experiments.records.load("results/cluster-demo")
    for setting in cluster_settings(records):
        busbw_on_cluster(records, "results/cluster-demo/plots", setting)   # -> PNG path
    head, rows = wire_table(records)

A point's records carry config["cluster"] (experiments/launchers.py).  On an
emulated cluster the cluster tool adds records of kind "wire", one a host:
the bytes that crossed its link during the point (experiments/cluster/wire.py),
with theory_tx_bytes from allreduce.theory.host_link_bytes when every
all-reduce of the job has a formula (not mpi, not training).  A bench record
may carry predicted_us (a cost model's time for it): it is drawn beside.
"""
import statistics
from collections import defaultdict

import matplotlib.pyplot as plt

from allreduce.units import format_size

from .launchers import describe_cluster
from .palette import measured_and_predicted, save, size_axis
from .records import slowest_rank, variant_of


def on_cluster(record):
    return bool(record.get("config", {}).get("cluster"))


def setting_of(record):
    """(launcher, nodes, ranks_per_node, Gbit/s, latency us): sorts 2 hosts before 4,
    1 Gbit/s before 10."""
    c = record["config"]
    k = c["cluster"]
    return (c.get("launcher", "emulated"), k["nodes"], k["ranks_per_node"],
            k.get("inter_gbps", 0), k.get("inter_latency_us", 0))


def setting_name(setting):
    launcher, nodes, rpn, gbps, latency = setting
    text = describe_cluster({"nodes": nodes, "ranks_per_node": rpn, "inter_latency_us": latency,
                             **({"inter_gbps": gbps} if gbps else {})})
    return text if launcher == "emulated" else f"{text} ({launcher})"


def cluster_settings(records):
    return sorted({setting_of(r) for r in records if on_cluster(r)})


def by_point(records, kind, command=None):
    """{point: [its records of `kind`]} of the points that ran on a cluster (of `command`)."""
    out = defaultdict(list)
    for r in records:
        if on_cluster(r) and r.get("kind") == kind and command in (None, r.get("command")):
            out[r["point"]].append(r)
    return out


def bench_rows(records, setting):
    return [r for r in records if on_cluster(r) and setting_of(r) == setting
            and r.get("command") == "allreduce.bench" and r.get("op") == "allreduce"
            and r.get("kind") != "wire"]


def busbw_on_cluster(records, out_dir, setting):
    """busbw against message size on one cluster setting, one line per algorithm (the
    median over repeated points, bars min-max); the host link's rate is the ceiling of
    the ring's busbw (each host sends 2(P-1)/P n across it, like every rank);
    predicted_us, where present, dashed."""
    rows = bench_rows(records, setting)
    if not rows:
        return None
    by_variant = defaultdict(lambda: defaultdict(list))
    predicted = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_variant[variant_of(r)][r["bytes"]].append(r["busbw_gbps"])
        if r.get("predicted_us"):
            predicted[variant_of(r)][r["bytes"]].append(
                r["busbw_gbps"] * r["time_us"] / r["predicted_us"])
    fig, ax = plt.subplots(figsize=(7, 4.4))
    measured_and_predicted(ax, by_variant, {v: {b: statistics.median(s) for b, s in at.items()}
                                            for v, at in predicted.items()})
    launcher, nodes, rpn, gbps, latency = setting
    if gbps:
        ax.axhline(gbps / 8, color="k", ls=":", lw=1, label=f"host link {gbps:g} Gbit/s")
    size_axis(ax.xaxis, [r["bytes"] for r in rows])
    ax.set(yscale="log", xlabel="message size", ylabel="busbw (GB/s)",
           title=f"all-reduce busbw, {setting_name(setting)}, P={rows[0]['world_size']}")
    ax.legend(fontsize=7)
    repeats = max(len(s) for at in by_variant.values() for s in at.values())
    name = f"busbw_cluster_{nodes}x{rpn}" + (f"_{gbps:g}gbps" if gbps else "") + (
        f"_{latency:g}us" if latency else "") + ("" if launcher == "emulated" else f"_{launcher}")
    return save(fig, out_dir, name.replace(".", "p"), note=(
        "solid with markers: measured, " + (f"the median of up to {repeats} repeated points; "
                                            "bars min-max" if repeats > 1 else "one point each")
        + "; dashed: predicted (the records' predicted_us)"))


def job_of(record):
    """What a point ran, in a few words: the bench's algorithms and sizes, or the sync."""
    c = record.get("config", {})
    if record.get("command") == "allreduce.bench":
        sizes = c.get("sizes") or ["?"]
        return f"bench {','.join(c.get('algos', []))}, {sizes[0]}..{sizes[-1]}"
    if record.get("command") == "strategies.train":
        return f"train {sync_of(c)}, {c.get('steps')} steps"
    return record.get("command", "?")


def sync_of(config):
    sync = config.get("sync", "?")
    return f"{sync} ({config.get('servers', 1)} servers)" if sync in ("ps", "hybrid") else sync


def mb(x):
    return f"{x / 1e6:.2f}"


def wire_table(records):
    """(head, rows): per point, the mean bytes each host sent across its link (less
    TCP/IP framing) beside theory, and their ratio on the hosts (lowest..highest)."""
    rows = []
    for wires in by_point(records, "wire").values():
        first = wires[0]
        sent = [w["tx_payload_bytes"] for w in wires]
        theory = [w.get("theory_tx_bytes") for w in wires]
        if all(t for t in theory):
            ratios = [s / t for s, t in zip(sent, theory)]
            compare = (mb(statistics.mean(theory)), f"{min(ratios):.3f}..{max(ratios):.3f}")
        else:
            compare = ("-", "-")
        rows.append((setting_of(first), job_of(first), len(wires), mb(statistics.mean(sent)),
                     *compare))
    rows = [(setting_name(s), *rest) for s, *rest in sorted(rows)]
    return (["cluster", "point", "hosts", "sent MB a host (measured)", "theory MB a host",
             "measured / theory"], rows)


def training_table(records):
    """(head, rows): per training point, samples/s, the median step of the slowest rank,
    and the MB each host sent across its link a step."""
    wires = by_point(records, "wire", "strategies.train")
    rows = []
    for point, of_point in by_point(records, "step", "strategies.train").items():
        slowest = slowest_rank(of_point)
        timed = [t for step, t in slowest.items() if step > 0] or list(slowest.values())
        cfg = of_point[0]["config"]
        per_step = (mb(statistics.mean(w["tx_payload_bytes"] for w in wires[point])
                       / len(slowest)) if wires[point] else "-")
        rows.append((setting_of(of_point[0]), sync_of(cfg), cfg.get("world_size"),
                     f"{cfg.get('global_batch', 64) * len(timed) / sum(timed):.0f}",
                     f"{1e3 * statistics.median(timed):.1f}", per_step))
    rows = [(setting_name(s), *rest) for s, *rest in sorted(rows)]
    return (["cluster", "sync", "ranks", "samples/s", "median step (ms)",
             "sent MB a host a step (setup included)"], rows)


def predicted_table(records):
    """(head, rows) of the bench rows that carry predicted_us, or None when none does."""
    # allreduce.bench predicts its other collectives too; this table is the all-reduce's
    rows = [r for r in records if on_cluster(r) and r.get("predicted_us")
            and r.get("command") == "allreduce.bench" and r.get("kind") != "wire"
            and r.get("op", "allreduce") == "allreduce"]
    if not rows:
        return None
    return (["cluster", "algorithm", "size", "measured us", "predicted us", "error"],
            [(setting_name(setting_of(r)), variant_of(r), format_size(r["bytes"]),
              f"{r['time_us']:.0f}",
              f"{r['predicted_us']:.0f}", f"{r['predicted_us'] / r['time_us'] - 1:+.0%}")
             for r in sorted(rows, key=lambda r: (setting_of(r), variant_of(r), r["bytes"]))])
