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
`allreduce.bench --link-gbps` and `strategies.train --link-gbps`.  State (what
is up, the hostfile, the launcher) lives in $TOPOLAB_CLUSTER_DIR
(default /tmp/topolab-cluster); every name starts with --prefix (default tl-).
An `up` or `down` after a crash removes what the crashed run left.
"""
import argparse
import json
import os
import sys
import time

from . import launch, net, wire

DEFAULT_DIR = "/tmp/topolab-cluster"
# Jobs that add link latency in their transport (allreduce/emulate.py) when the kernel cannot.
TRANSPORT_LATENCY = ("allreduce.bench", "strategies.train")


def run_dir():
    return os.environ.get("TOPOLAB_CLUSTER_DIR") or DEFAULT_DIR


def state_path():
    return os.path.join(run_dir(), "state.json")


def load_state():
    try:
        with open(state_path()) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise net.ClusterError(f"{state_path()} is unreadable ({e}): remove it, "
                               f"then `down --prefix P` removes the pieces") from None


def save_state(state):
    tmp = state_path() + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, state_path())


def layout_of(state):
    return net.Layout(state["nodes"], state["prefix"], state["subnet"])


def tear_down(prefix=None):
    """Stop the recorded mpiexec, remove every piece named with the prefix and the
    run directory's files.  Returns the names removed."""
    state = load_state()
    prefixes = {p for p in (prefix, state and state["prefix"]) if p}
    if state and state.get("mpiexec_pid") and launch.is_our_mpiexec(state["mpiexec_pid"]):
        launch.stop_group(state["mpiexec_pid"])
    removed = []
    for p in sorted(prefixes):
        removed += net.destroy(p)
    for name in ("state.json", "hostfile", "launcher.sh", "hosts"):
        try:
            os.remove(os.path.join(run_dir(), name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(run_dir())
    except OSError:
        pass          # not empty: files someone else put there stay
    return removed


def bring_up(a):
    """Create and shape the cluster `a` describes; returns its state."""
    layout = net.Layout(a.nodes, a.prefix, a.subnet)
    if a.ranks_per_node < 1 or a.inter_gbps <= 0 or a.inter_latency_us < 0:
        raise net.ClusterError(f"need --ranks-per-node >= 1 (got {a.ranks_per_node}), "
                               f"--inter-gbps > 0 (got {a.inter_gbps:g}), "
                               f"--inter-latency-us >= 0 (got {a.inter_latency_us:g})")
    stale = tear_down(a.prefix)
    if stale:
        print(f"removed stale {', '.join(stale)}", file=sys.stderr)
    os.makedirs(run_dir(), exist_ok=True)
    state = {"nodes": a.nodes, "ranks_per_node": a.ranks_per_node, "inter_gbps": a.inter_gbps,
             "inter_latency_us": a.inter_latency_us, "latency_by": None, "prefix": a.prefix,
             "subnet": a.subnet, "mpiexec_pid": None, "since": time.time()}
    save_state(state)         # first, so that a crash from here on is cleaned up by prefix
    try:
        net.create(layout)
        state["latency_by"] = net.shape(layout, a.inter_gbps, a.inter_latency_us)
        state["hostfile"], state["launcher"] = launch.write_files(run_dir(), layout,
                                                                  a.ranks_per_node)
        save_state(state)
    except BaseException:
        tear_down(a.prefix)
        raise
    print(describe(state), file=sys.stderr)
    return state


def describe(state):
    layout = layout_of(state)
    hosts = ", ".join(f"{layout.host(i)}={layout.address(i)}" for i in range(layout.nodes))
    latency = {"none": "0 us",
               "netem": f"{state['inter_latency_us']:g} us one way (netem)",
               "transport": f"{state['inter_latency_us']:g} us added by the job's transport "
                            f"(this kernel has no netem; allreduce/emulate.py delays every "
                            f"message of the textbook algorithms, inside a host too)"}
    return (f"cluster: {state['nodes']} hosts x {state['ranks_per_node']} ranks ({hosts}); "
            f"links {state['inter_gbps']:g} Gbit/s each way (tbf), latency "
            f"{latency[state['latency_by']]}")


def with_latency(state, job):
    """The job with --link-latency-us added where the kernel cannot add latency."""
    if state["latency_by"] != "transport" or "--link-latency-us" in job:
        return job
    if job[0] not in TRANSPORT_LATENCY:
        raise net.ClusterError(
            f"this kernel has no netem, so the links cannot add latency, and {job[0]} has no "
            f"--link-latency-us of its own (only {', '.join(TRANSPORT_LATENCY)} do): "
            f"bring the cluster up with --inter-latency-us 0")
    return job + ["--link-latency-us", f"{state['inter_latency_us']:g}"]


def jsonl_of(job):
    for i, arg in enumerate(job):
        if arg == "--jsonl" and i + 1 < len(job):
            return job[i + 1]
        if arg.startswith("--jsonl="):
            return arg.split("=", 1)[1]
    return None


def run_on(state, job, jsonl):
    """Run the job on the cluster that is up; prints and records its wire bytes."""
    layout = layout_of(state)
    job = with_latency(state, job)
    cmd = launch.job_command(layout, state["ranks_per_node"], state["hostfile"],
                             state["launcher"], job)

    def started(pid):
        state["mpiexec_pid"] = pid
        save_state(state)
    before = wire.snapshot(layout, layout.nodes)
    code = launch.run_job(cmd, launch.rank_env(layout), started)
    after = wire.snapshot(layout, layout.nodes)
    state["mpiexec_pid"] = None
    save_state(state)
    spec = {k: state[k] for k in ("nodes", "ranks_per_node", "inter_gbps", "inter_latency_us",
                                  "latency_by")}
    records = wire.wire_records(layout, before, after, " ".join(job), spec)
    theory = wire.job_theory(job[0], job[1:], layout.nodes, state["ranks_per_node"]) \
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
    own = a.nodes is not None
    state = bring_up(a) if own else load_state()
    if state is None:
        raise net.ClusterError(f"no cluster is up ({state_path()} missing): give --nodes, "
                               f"--ranks-per-node and --inter-gbps, or run `up` first")
    running = state.get("mpiexec_pid")
    if not own and running and launch.is_our_mpiexec(running):
        raise net.ClusterError(f"a job is running on this cluster (mpiexec pid {running}); "
                               f"wait for it, or `down` ends it")
    try:
        return run_on(state, job, a.jsonl)
    finally:
        if own:
            tear_down(a.prefix)


def cmd_status(a):
    state = load_state()
    prefix = state["prefix"] if state else a.prefix
    namespaces, links = net.ours(prefix)
    if not state:
        print(f"no cluster up ({state_path()} missing)" +
              (f"; stale: {', '.join(namespaces + links)}" if namespaces or links else ""))
        return 0
    print(describe(state))
    layout = layout_of(state)
    for i in range(layout.nodes):
        present = layout.host(i) in namespaces
        print(f"  {layout.host(i)}: {'up' if present else 'MISSING'}", end="")
        if present:
            c = net.counters(layout, i)
            root, host = net.qdiscs(layout, i)
            print(f"  tx {c['tx_bytes']} B, rx {c['rx_bytes']} B;  {host} / {root}", end="")
        print()
    pid = state.get("mpiexec_pid")
    if pid:
        print(f"  job: mpiexec pid {pid} {'running' if launch.is_our_mpiexec(pid) else 'gone'}")
    return 0


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
    where.add_argument("--prefix", default="tl-", help="of every namespace and link name")
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
        if a.command == "up":
            if a.nodes is None:
                parser.error("up needs --nodes")
            net.require_privileges()
            with launch.signals_raise():
                bring_up(a)
            return 0
        if a.command == "run":
            with launch.signals_raise():
                return cmd_run(a, job)
        if a.command == "status":
            return cmd_status(a)
        net.require_privileges()
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
