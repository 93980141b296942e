"""An emulated cluster on one Linux machine: N hosts of R ranks each, links shaped by tc.

Bring it up, run one job across it, tear it down (also on Ctrl-C, SIGTERM or a
failure), exit with the job's code:
    sudo python -m experiments.cluster run --nodes 2 --ranks-per-node 2 --inter-gbps 1 -- \\
        allreduce.bench --algos ring,hierarchical --sizes 16M --jsonl r.jsonl
Several jobs on one cluster (`run` without --nodes uses the cluster that is up
and leaves it up):
    sudo python -m experiments.cluster up --nodes 2 --ranks-per-node 2 --inter-gbps 1
    sudo python -m experiments.cluster run -- strategies.train --sync hierarchical ...
    sudo python -m experiments.cluster run -- tests/mpi/collectives_matrix.py
    python -m experiments.cluster status
    sudo python -m experiments.cluster down

A job is MODULE ARGS (run as `python -m mpi4py -m MODULE ARGS`) or SCRIPT.py ARGS.
After it, the tool prints the bytes that crossed each host's link beside what
theory predicts (allreduce.bench jobs) and appends one record of kind "wire" a
host to --jsonl (default: the job's own --jsonl file).

Needs root (CAP_NET_ADMIN): without it, use the application-level emulation,
`allreduce.bench --link-gbps` and `strategies.train --link-gbps`.  Every name
starts with --prefix (default tl-; `run`, `status` and `down` take the one
cluster recorded, if there is one); each cluster's record (what is up, the
hostfile, the launcher) lives in $TOPOLAB_CLUSTER_DIR/PREFIX (default
/tmp/topolab-cluster/tl-).  Clusters side by side (state.py): `up` never touches
a live cluster (one that is up, runs a job, or is being made), whatever
directory it was made from: it refuses, naming it, and exits 2.  What a crash
left (pieces with no process inside and no live owner) the next `up` removes,
and `down --prefix P` removes a cluster whatever its state.
"""
import argparse
import os
import sys
import time

from . import launch, net, state, wire
from .state import CREATING, OWN_JOB, UP

DEFAULT_PREFIX = "tl-"
# Jobs that add link latency in their transport (allreduce/emulate.py) when the kernel cannot.
TRANSPORT_LATENCY = ("allreduce.bench", "strategies.train")


def layout_of(record):
    return net.Layout(record["nodes"], record["prefix"], record["subnet"])


def tear_down(prefix):
    """Stop the recorded mpiexec, remove every piece named with the prefix and this
    directory's files of it.  The caller holds the cluster's lock.  Returns the names
    removed."""
    try:
        record = state.load(prefix)
    except net.ClusterError:
        record = None                 # unreadable: its files go all the same
    if record and record["mpiexec_pid"] and launch.is_our_mpiexec(record["mpiexec_pid"]):
        launch.stop_group(record["mpiexec_pid"])
    removed = net.destroy(prefix)
    state.forget(prefix)
    return removed


def bring_up(a, phase):
    """Create and shape the cluster `a` describes, for `phase` (UP: until `down`;
    OWN_JOB: for this process's job); returns its record.  The caller holds the
    cluster's lock.  A live cluster with the prefix is refused, a stale one removed."""
    layout = net.Layout(a.nodes, a.prefix, a.subnet)
    if a.ranks_per_node < 1 or a.inter_gbps <= 0 or a.inter_latency_us < 0:
        raise net.ClusterError(f"need --ranks-per-node >= 1 (got {a.ranks_per_node}), "
                               f"--inter-gbps > 0 (got {a.inter_gbps:g}), "
                               f"--inter-latency-us >= 0 (got {a.inter_latency_us:g})")
    _, why = state.live_reason(a.prefix)
    if why:
        raise net.ClusterError(f"cluster {a.prefix} is in use, so `{a.command}` leaves it "
                               f"alone: {why}.  Choose another --prefix (and --subnet), or "
                               f"end it with `down --prefix {a.prefix}`")
    stale = tear_down(a.prefix)
    if stale:
        print(f"removed stale {', '.join(stale)}", file=sys.stderr)
    record = {"nodes": a.nodes, "ranks_per_node": a.ranks_per_node, "inter_gbps": a.inter_gbps,
              "inter_latency_us": a.inter_latency_us, "latency_by": None, "prefix": a.prefix,
              "subnet": a.subnet, "phase": CREATING, "owner": state.me(), "hostfile": None,
              "launcher": None, "mpiexec_pid": None, "since": time.time()}
    mark = state.mark_of(record)
    state.save(record)        # first, so that a crash from here on is cleaned up by prefix
    try:
        with state.subnet_lock():
            net.create(layout, mark)
        record["latency_by"] = net.shape(layout, a.inter_gbps, a.inter_latency_us)
        record["hostfile"], record["launcher"] = launch.write_files(
            state.cluster_dir(a.prefix), layout, a.ranks_per_node)
        record["phase"] = phase
        state.save(record)
        net.set_mark(a.prefix, state.mark_of(record))   # last: now it is live
    except BaseException:
        tear_down(a.prefix)
        raise
    print(describe(record), file=sys.stderr)
    return record


def not_usable(record):
    """None if jobs may run on the recorded cluster; else why not, in words."""
    prefix = record["prefix"]
    if record["phase"] == CREATING:
        return f"cluster {prefix} is not ready: {state.owner_words(record)}"
    if record["phase"] == OWN_JOB:
        return f"cluster {prefix} was made by `run --nodes` for one job: " \
            f"{state.owner_words(record)}"
    mark = net.read_mark(prefix, state.MARK_BY)
    if mark is None:
        return f"cluster {prefix} is not on this machine any more (no {prefix}br, or not ours)"
    if mark.get("dir") != os.path.abspath(state.run_dir()) or mark.get("phase") != UP:
        return f"cluster {prefix} on this machine is not the one recorded here: it was made " \
            f"from {mark.get('dir')} ({mark.get('phase')})"
    return None


def describe(record):
    layout = layout_of(record)
    hosts = ", ".join(f"{layout.host(i)}={layout.address(i)}" for i in range(layout.nodes))
    latency = {"none": "0 us",
               "netem": f"{record['inter_latency_us']:g} us one way (netem)",
               "transport": f"{record['inter_latency_us']:g} us added by the job's transport "
                            f"(this kernel has no netem; allreduce/emulate.py delays every "
                            f"message of the textbook algorithms, inside a host too)"}
    return (f"cluster: {record['nodes']} hosts x {record['ranks_per_node']} ranks ({hosts}); "
            f"links {record['inter_gbps']:g} Gbit/s each way (tbf), latency "
            f"{latency[record['latency_by']]}")


def with_latency(record, job):
    """The job with --link-latency-us added where the kernel cannot add latency."""
    if record["latency_by"] != "transport" or "--link-latency-us" in job:
        return job
    if job[0] not in TRANSPORT_LATENCY:
        raise net.ClusterError(
            f"this kernel has no netem, so the links cannot add latency, and {job[0]} has no "
            f"--link-latency-us of its own (only {', '.join(TRANSPORT_LATENCY)} do): "
            f"bring the cluster up with --inter-latency-us 0")
    return job + ["--link-latency-us", f"{record['inter_latency_us']:g}"]


def jsonl_of(job):
    for i, arg in enumerate(job):
        if arg == "--jsonl" and i + 1 < len(job):
            return job[i + 1]
        if arg.startswith("--jsonl="):
            return arg.split("=", 1)[1]
    return None


def run_on(record, job, jsonl, lock=None):
    """Run the job on the cluster; prints and records its wire bytes.  `lock`, held
    since the check that no job runs, is let go once mpiexec's pid is recorded."""
    layout = layout_of(record)
    job = with_latency(record, job)
    cmd = launch.job_command(layout, record["ranks_per_node"], record["hostfile"],
                             record["launcher"], job)

    def started(pid):
        record["mpiexec_pid"] = pid
        state.save(record)
        if lock:
            lock.release()
    before = wire.snapshot(layout, layout.nodes)
    code = launch.run_job(cmd, launch.rank_env(layout), started)
    with state.cluster_lock(record["prefix"]):
        now = state.load(record["prefix"])
        if now is None or now["since"] != record["since"]:
            print(f"topolab-cluster: cluster {record['prefix']} was taken down during the job; "
                  f"no wire records", file=sys.stderr)
            return code
        after = wire.snapshot(layout, layout.nodes)
        record["mpiexec_pid"] = None
        state.save(record)
    spec = {k: record[k] for k in ("nodes", "ranks_per_node", "inter_gbps", "inter_latency_us",
                                   "latency_by")}
    records = wire.wire_records(layout, before, after, " ".join(job), spec)
    theory = wire.job_theory(job[0], job[1:], layout.nodes, record["ranks_per_node"]) \
        if code == 0 else None
    for i, r in enumerate(records):
        r["theory_tx_bytes"] = theory[i] if theory else None
        r["exit_code"] = code
    wire.print_table(records, theory)
    jsonl = jsonl or jsonl_of(job)
    if jsonl:
        from allreduce.records import append_jsonl, provenance  # imports torch: only after a job
        meta = provenance()
        append_jsonl(jsonl, [{**r, "provenance": meta} for r in records])
    return code


def cmd_run(a, job):
    if not job:
        raise net.ClusterError("run needs a job after `--`: MODULE ARGS... (or SCRIPT.py ARGS...)")
    net.require_privileges()
    if a.nodes is not None:                     # a cluster of its own, for this job
        with state.cluster_lock(a.prefix):
            record = bring_up(a, OWN_JOB)
        try:
            return run_on(record, job, a.jsonl)
        finally:
            with state.cluster_lock(a.prefix):
                tear_down(a.prefix)
    with state.cluster_lock(a.prefix) as lock:  # one job at a time: checked, then started
        record = state.load(a.prefix)
        if record is None:
            raise net.ClusterError(f"no cluster {a.prefix} is up ({state.state_path(a.prefix)} "
                                   f"missing): give --nodes, --ranks-per-node and "
                                   f"--inter-gbps, or run `up` first")
        why = not_usable(record)
        if why:
            raise net.ClusterError(f"{why}; `down --prefix {a.prefix}` removes it, then `up`")
        running = record["mpiexec_pid"]
        if running and launch.is_our_mpiexec(running):
            raise net.ClusterError(f"a job is running on this cluster (mpiexec pid {running}); "
                                   f"wait for it, or `down` ends it")
        return run_on(record, job, a.jsonl, lock)


def cmd_status(a):
    record = state.load(a.prefix)
    pieces, why = state.live_reason(a.prefix)
    if record is None:
        print(f"no cluster {a.prefix} up ({state.state_path(a.prefix)} missing)" +
              (f"; on this machine: {', '.join(pieces)}: "
               f"{why or 'stale, the next `up` or `down` removes them'}" if pieces else ""))
        return 0
    if record["phase"] == CREATING:
        print(not_usable(record) + ("" if state.alive(record["owner"]) else
                                    f"; `down --prefix {a.prefix}` removes what it left, "
                                    f"as does the next `up`"))
        return 0
    print(describe(record))
    layout = layout_of(record)
    for i in range(layout.nodes):
        present = layout.host(i) in pieces
        print(f"  {layout.host(i)}: {'up' if present else 'MISSING'}", end="")
        if present:
            c = net.counters(layout, i)
            root, host = net.qdiscs(layout, i)
            print(f"  tx {c['tx_bytes']} B, rx {c['rx_bytes']} B;  {host} / {root}", end="")
        print()
    pid = record["mpiexec_pid"]
    if pid:
        print(f"  job: mpiexec pid {pid} {'running' if launch.is_our_mpiexec(pid) else 'gone'}")
    trouble = not_usable(record)
    if trouble:
        print(f"  {trouble}")
    return 0


def chosen_prefix(a):
    """--prefix, else: `up` and `run --nodes` make tl-; the others take the one cluster
    recorded in the directory (tl- if none)."""
    if a.prefix is not None or a.command == "up" or getattr(a, "nodes", None) is not None:
        return a.prefix or DEFAULT_PREFIX
    found = [p for p in state.recorded() if prefix_ok(p)]
    if len(found) > 1:
        raise net.ClusterError(f"clusters {', '.join(found)} are recorded in {state.run_dir()}: "
                               f"name one with --prefix")
    return found[0] if found else DEFAULT_PREFIX


def prefix_ok(prefix):
    try:
        net.check_prefix(prefix)
    except net.ClusterError:
        return False
    return True


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    shape = argparse.ArgumentParser(add_help=False)
    shape.add_argument("--nodes", type=int, help="emulated hosts")
    shape.add_argument("--ranks-per-node", type=int, default=1)
    shape.add_argument("--inter-gbps", type=float, default=1.0,
                       help="bandwidth of each host's link, each way, Gbit/s (tc tbf)")
    shape.add_argument("--inter-latency-us", type=float, default=0.0,
                       help="one-way latency between hosts (netem; else the job's transport)")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--prefix", help=f"of every namespace and link name (up: default "
                                        f"{DEFAULT_PREFIX}; else the one cluster recorded)")
    where.add_argument("--subnet", default="10.77.0.0/24", help="private range for the hosts")
    sub.add_parser("up", parents=[shape, where], help="bring the cluster up")
    run = sub.add_parser("run", parents=[shape, where],
                         help="run a job (after --); with --nodes on a cluster of its own")
    run.add_argument("--jsonl", help="append the wire records here (default: the job's --jsonl)")
    sub.add_parser("status", parents=[where], help="what is up")
    sub.add_parser("down", parents=[where], help="tear everything down")
    return p, p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    job = []
    if "--" in argv:
        i = argv.index("--")
        argv, job = argv[:i], argv[i + 1:]
    parser, a = parse_args(argv)
    if job and a.command != "run":
        parser.error(f"only `run` takes a job after --, not `{a.command}`")
    try:
        a.prefix = chosen_prefix(a)
        net.check_prefix(a.prefix)
        if a.command == "up":
            if a.nodes is None:
                parser.error("up needs --nodes")
            net.require_privileges()
            with launch.signals_raise(), state.cluster_lock(a.prefix):
                bring_up(a, UP)
            return 0
        if a.command == "run":
            with launch.signals_raise():
                return cmd_run(a, job)
        if a.command == "status":
            return cmd_status(a)
        net.require_privileges()
        with state.cluster_lock(a.prefix):
            removed = tear_down(a.prefix)
        print(f"removed {', '.join(removed)}" if removed else "nothing was up")
        return 0
    except launch.Interrupted as e:
        done = ("torn down" if a.command == "up" else "job ended, cluster torn down"
                if a.nodes is not None else "job ended, the cluster stays up")
        print(f"topolab-cluster: interrupted by {e}; {done}", file=sys.stderr)
        return 128 + e.signum
    except net.ClusterError as e:
        print(f"topolab-cluster: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
