"""Run a matrix of experiments described in a TOML file; resumable, bounded, recorded.

    python -m experiments.sweep experiments/demo.toml              # -> results/demo/
    python -m experiments.sweep my.toml --out results/mine --dry-run   # list the points
    python -m experiments.report results/demo                      # then the plots and report

A sweep file has a [sweep] table and one [[run]] table per command:

    [sweep]
    name = "demo"            # the default results directory is results/NAME
    timeout_s = 120          # per point (a [[run]] may set its own)

    [[run]]
    command = "allreduce.bench"
    world_size = [2, 4]                       # an axis: one point per value
    link_latency_us = [0, 100]                # another axis: 2 x 2 = 4 points
    algos = ["ring", "tree"]                  # a list the command takes whole:
    sizes = ["4K", "1M", "16M"]               #   interleaved inside each point
    iters = 10

A list is an axis (the points are the product of all axes) except for the keys
a command takes as one comma-separated list (experiments/sweepfile.py, SCHEMA).

Where the points run (experiments/launchers.py), in [sweep] or per [[run]]:

    launcher = "local"              # the default: mpiexec -n P on this host
    launcher = "hostfile:hosts"     # mpiexec -f hosts -n P (relative: beside this file)
    launcher = "slurm"              # srun -n P --mpi=pmi2 (salloc first outside a job)
    cluster = [{nodes = 2, ranks_per_node = 2, inter_gbps = 1},     # an axis of emulated
               {nodes = 4, ranks_per_node = 1, inter_gbps = 10}]    # clusters (root)

A point on an emulated cluster runs through `python -m experiments.cluster run`
on a cluster of its own (world size = nodes x ranks_per_node); the bytes that
crossed each host's link come back as records of kind "wire".  Its namespaces
are named --cluster-prefix* (default ts-) in --cluster-subnet; one sweep at a
time uses a prefix (a lock), and nothing with it is left after a point.

Unknown keys, values of the wrong type, a name that is not a plain folder name,
a file that is not UTF-8 or has no [[run]], more points than --max-points
(default 10,000: experiments/sweepfile.py, MAX_POINTS), and impossible points
(ranks that do not factor, a batch that does not split, link emulation of a
baseline that cannot be slowed, a world size its cluster does not have) are
reported with their line and reason before anything runs, and so is a
launcher this machine lacks (srun, root for namespaces).  Each
point runs under its launcher (psrv.bench and experiments.calibrate start their
own processes, on this host) with a time limit; points already done are
skipped, so an interrupted sweep resumes where it stopped; a point that crashes
or times out is recorded as failed, with its log, and the sweep goes on.  The
layout of the results directory is in experiments/records.py.

Exit status: 0 when every point succeeded, 1 when any failed or timed out (the
rest still ran), 2 when the file was rejected, 128 + the signal's number when
SIGINT, SIGTERM or SIGHUP stopped the sweep.  A stopping signal kills the
running point's whole process group (mpiexec and its ranks run in a session
of their own, so the terminal's Ctrl-C never reaches them; the emulated
cluster's tool and srun get SIGTERM first, to tear down); the point is not
recorded, and running the sweep again runs it.
"""
import argparse
import hashlib
import json
import os
import shlex
import signal
import sys

from allreduce.cli import add_output_flags

from . import launchers
from .launchers import LAUNCH_KEYS, ClusterLock, ClusterPlace, describe_cluster
from .points import Stopper, run_point
from .records import append_jsonl, provenance, read_jsonl
from .sweepfile import MAX_POINTS, SweepError, defaults_of, full_config, load_sweep

__all__ = ["SweepError", "load_sweep", "command_line", "point_id", "main"]


def point_id(command, params):
    blob = json.dumps({"command": command, **params}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def flag(key):
    return "--" + key.replace("_", "-")


def calibration_path(raw, cluster):
    """The directory of the calibration of `cluster`: RESULTS/calibration/2x2-1gbit-0us/.
    The experiments.calibrate point on that cluster writes calibration.json there
    (--out); the allreduce.bench points with `predict = true` on the same cluster
    read it (--predict), so the calibrate [[run]] comes first in the file."""
    name = (f"{cluster['nodes']}x{cluster['ranks_per_node']}-{cluster['inter_gbps']:g}gbit-"
            f"{cluster['inter_latency_us']:g}us")
    return os.path.join(os.path.dirname(os.path.dirname(raw)), "calibration", name)


def command_line(command, p, raw, place=None):
    """The argv of one point; its records go to `raw`.  `place`: where an emulated
    cluster lives (launchers.ClusterPlace; the default one when None)."""
    py = sys.executable
    if command == "psrv.bench":              # the point's config: its defaults filled in
        c = full_config(command, p)
        return [py, "-m", "psrv.bench", "--workers", str(c["workers"]), "--servers",
                str(c["servers"]), "--reps", str(c["reps"]), "--jsonl", raw] + (
                    ["--sizes", ",".join(map(str, p["sizes"]))] if "sizes" in p else [])
    if command == "experiments.calibrate":
        tail = ["--jsonl", raw, "--reps", str(p.get("reps", 15))] + (
            ["--verify", ",".join(p["verify"])] if "verify" in p else [])
        if p.get("cluster"):                     # across the hosts: both levels, for --predict
            return launchers.head(command, p, place) + tail + [
                "--out", calibration_path(raw, p["cluster"])]
        return [py, "-m", "experiments.calibrate"] + tail + ([] if p.get("ps", True) else
                                                             ["--no-ps"])
    head = launchers.head(command, p, place)
    cluster, defaults = p.get("cluster"), defaults_of(command)
    args = []
    for k, v in p.items():
        if k in LAUNCH_KEYS + ("world_size", "progress"):     # head's, or the sweep's own
            continue
        if k == "predict":                       # the model's time beside each measured row
            args += ["--predict", calibration_path(raw, cluster)] if v else []
        elif k == "trace":                       # a Chrome trace beside the point's records
            args += ["--trace", raw[:-len(".jsonl")] + ".trace.json"] if v else []
        elif isinstance(defaults.get(k), bool):  # a switch: named when it differs
            if v != defaults[k]:
                args.append(flag(k) if v else "--no-" + k.replace("_", "-"))
        else:
            args += [flag(k), ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    if command == "strategies.train":
        args.append("--no-progress")
    return head + args + ["--jsonl", raw]


def point_limit(text):
    """--max-points: a whole number >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of points >= 1, got {text!r}")
    return int(text)


def parser():
    ap = argparse.ArgumentParser(prog="python -m experiments.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="the sweep's TOML file (experiments/demo.toml is one)")
    add_output_flags(ap, jsonl=False, out_what="the results: records.jsonl, points.jsonl, "
                                               "logs/ (default results/NAME)")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the file, list the points and their command lines")
    ap.add_argument("--max-points", type=point_limit, default=MAX_POINTS, metavar="N",
                    help=f"refuse a sweep of more than N points (default {MAX_POINTS:,}: "
                         f"more is nearly always an axis written wrong)")
    ap.add_argument("--cluster-prefix", default=ClusterPlace.prefix,
                    help="of the emulated clusters' namespaces and links (launcher emulated)")
    ap.add_argument("--cluster-subnet", default=ClusterPlace.subnet,
                    help="private range of the emulated clusters' hosts")
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    try:
        settings, points = load_sweep(a.file, a.max_points)
    except (SweepError, OSError) as e:
        print(f"sweep rejected, nothing was run:\n{e}", file=sys.stderr)
        return 2
    out = a.out or os.path.join("results", settings["name"])
    place = ClusterPlace(a.cluster_prefix, a.cluster_subnet)
    if a.dry_run:
        for command, params, timeout, _ in points:
            pid = point_id(command, params)
            print(pid, command, json.dumps(params))
            raw = os.path.abspath(os.path.join(out, "raw", pid + ".jsonl"))
            print("    $ " + shlex.join(command_line(command, params, raw, place)))
        return 0
    missing = launchers.needs(points, place)
    if missing:
        print("sweep rejected, nothing was run:\n" + "\n".join(missing), file=sys.stderr)
        return 2
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    stopper = Stopper()
    previous = stopper.install()
    try:
        return run_points(settings, points, out, stopper, place)
    finally:
        Stopper.restore(previous)


# The cluster tool's own teardown after SIGTERM: namespaces, links, mpiexec (GRACE 5 s).
CLUSTER_GRACE_S = 20.0


def run_launched(params, argv, log, timeout, stopper, place=None):
    """run_point for the point's launcher.  An emulated cluster's point holds the
    place's lock, lets the cluster tool tear down on a timeout or a stop, and
    leaves no namespace behind; srun and salloc pass SIGTERM on to the ranks."""
    kind = params.get("launcher", "local").split(":")[0]
    if kind != "emulated":
        return run_point(argv, log, timeout, stopper, grace_s=5.0 if kind == "slurm" else 0.0)
    place = place or ClusterPlace()
    with ClusterLock(place, lambda: stopper.signum is not None):
        try:
            return run_point(argv, log, timeout, stopper, place.env(), CLUSTER_GRACE_S)
        finally:
            launchers.tear_down(place, log)


def run_points(settings, points, out, stopper, place=None):
    """Run the points not done before; returns the exit status (see the module's doc)."""
    status_file = os.path.join(out, "points.jsonl")
    records_file = os.path.join(out, "records.jsonl")
    done = {s["point"] for s in read_jsonl(status_file) if s.get("status") == "ok"}
    meta = provenance()
    failed = 0
    for i, (command, params, timeout, label) in enumerate(points, 1):
        if stopper.signum is not None:
            break
        pid = point_id(command, params)
        shown = " ".join(f"{k}={describe_cluster(v) if k == 'cluster' else v}"
                         for k, v in params.items() if not isinstance(v, list))
        if pid in done:
            print(f"[{i}/{len(points)}] {command} {shown}: done before, skipped", flush=True)
            continue
        raw = os.path.join(out, "raw", pid + ".jsonl")
        log = os.path.join(out, "logs", pid + ".log")
        if os.path.exists(raw):
            os.unlink(raw)                      # a half-written earlier attempt
        argv_ = command_line(command, params, os.path.abspath(raw), place)
        meta["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        try:
            status, rc, wall = run_launched(params, argv_, log, timeout, stopper, place)
        except InterruptedError:                # stopped while waiting for the cluster
            break
        if status == "stopped":
            break
        found = read_jsonl(raw)
        if status == "ok" and not found:
            status = "failed"                   # exited 0 but measured nothing
        common = {"command": command, "point": pid, "sweep": settings["name"], "label": label,
                  "config": full_config(command, params), "provenance": dict(meta)}
        if status == "ok":
            append_jsonl(records_file, [{**r, **common} for r in found])
        else:
            failed += 1
        append_jsonl(status_file, [{**common, "status": status, "returncode": rc,
                                    "wall_s": round(wall, 2), "argv": argv_, "log": log}])
        print(f"[{i}/{len(points)}] {command} {shown}: {status} in {wall:.1f} s"
              + ("" if status == "ok" else f" (log: {log})"), flush=True)
    if stopper.signum is not None:
        name = signal.Signals(stopper.signum).name
        print(f"sweep {settings['name']}: stopped by {name}; the running point was killed "
              f"and not recorded; run the same command again to go on", file=sys.stderr,
              flush=True)
        return 128 + stopper.signum
    print(f"sweep {settings['name']}: {len(points)} points, {failed} failed; results in {out}",
          flush=True)
    if failed:
        print(f"sweep {settings['name']}: {failed} of {len(points)} points failed or timed "
              f"out; their logs are in {os.path.join(out, 'logs')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
