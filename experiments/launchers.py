"""Where a sweep's points run: this host, an emulated cluster, a hostfile's hosts, or Slurm.

    launcher = "local"            mpiexec -n P python -m mpi4py -m MODULE ARGS
    launcher = "emulated"         python -m experiments.cluster run --nodes N --ranks-per-node R
                                      --inter-gbps G --prefix ts- --subnet S -- MODULE ARGS
    launcher = "hostfile:FILE"    mpiexec -f FILE -n P python -m mpi4py -m MODULE ARGS
    launcher = "slurm"            srun -n P --mpi=pmi2 python -m mpi4py -m MODULE ARGS
                                  (outside an allocation: salloc -n P srun ...)

A sweep names a cluster as an inline table, in [sweep] or in a [[run]]; a list
of tables is an axis, one point per cluster (experiments/sweep.py shows one).
A cluster without a launcher runs on the emulated one (experiments/cluster:
network namespaces, links shaped by tc; needs root).  Under Slurm a cluster
asks for its nodes and ranks (`srun -N nodes --ntasks-per-node R`); its links
are the machine's, so it takes no inter_gbps.  The world size is
nodes x ranks_per_node; a point that says otherwise is refused.

psrv.bench starts its own processes on this host: it runs with the local
launcher only.  So does experiments.calibrate, except on a cluster of two hosts
or more, where it runs across them and measures both levels, the link's alpha
and beta among them (calibrate_link.py), for `predict = true` bench points.
"""
import fcntl
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from allreduce.emulate import emulated
from allreduce.records import checkout_pythonpath

from .records import ROOT, mpiexec_path

LAUNCH_KEYS = ("launcher", "cluster")
MPI_COMMANDS = ("allreduce.bench", "strategies.train")
# cluster table: key -> (default, smallest value allowed, whole number)
CLUSTER_KEYS = {"nodes": (None, 1, True), "ranks_per_node": (1, 1, True),
                "inter_gbps": (1.0, 0, False), "inter_latency_us": (0.0, 0, False)}


def parse_launcher(value, base_dir="."):
    """("local" | "emulated" | "slurm", None) or ("hostfile", absolute path).
    A relative hostfile is found beside the sweep file.  ValueError with the reason."""
    if not isinstance(value, str):
        raise ValueError(f"launcher must be a string, got {value!r}")
    if value in ("local", "emulated", "slurm"):
        return value, None
    if value.startswith("hostfile:") and value[len("hostfile:"):]:
        path = os.path.join(base_dir, os.path.expanduser(value[len("hostfile:"):]))
        path = os.path.abspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"launcher {value!r}: no hostfile {path}")
        with open(path) as f:
            if not any(line.split("#")[0].strip() for line in f):
                raise ValueError(f"launcher {value!r}: {path} names no host (one HOST[:SLOTS] "
                                 f"a line)")
        return "hostfile", path
    raise ValueError(f"launcher {value!r} is not one of local, emulated, hostfile:FILE, slurm")


def cluster_problem(table):
    """None, or why `table` is not a cluster {nodes, ranks_per_node, inter_gbps,
    inter_latency_us}."""
    if not isinstance(table, dict):
        return (f"cluster must be a table like {{nodes = 2, ranks_per_node = 2, "
                f"inter_gbps = 1}} (or a list of them), got {table!r}")
    unknown = sorted(set(table) - set(CLUSTER_KEYS))
    if unknown:
        return f"unknown key {unknown[0]!r} in cluster; known: {', '.join(CLUSTER_KEYS)}"
    if "nodes" not in table:
        return f"cluster {table} needs nodes"
    for key, value in table.items():
        _, least, whole = CLUSTER_KEYS[key]
        kinds = (int,) if whole else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or value < least or \
                (key == "inter_gbps" and value <= 0):
            want = "a whole number" if whole else "a number"
            bound = "> 0" if key == "inter_gbps" else f">= {least}"
            return f"cluster {key} must be {want} {bound}, got {value!r}"
    return None


def resolve(launcher, cluster, base_dir="."):
    """(launcher, [cluster or None, one per point]) from a sweep's values (None where the
    file gives none); ValueError((key, reason)) for a wrong one.  A cluster without a
    launcher means the emulated one."""
    if launcher is None:
        launcher = "emulated" if cluster is not None else "local"
    try:
        kind, hostfile = parse_launcher(launcher, base_dir)
    except ValueError as e:
        raise ValueError(("launcher", str(e))) from None
    launcher = f"hostfile:{hostfile}" if hostfile else kind     # a hostfile's path made absolute
    if cluster is None:
        return launcher, [None]
    tables = cluster if isinstance(cluster, list) else [cluster]
    if not tables:
        raise ValueError(("cluster", "cluster = [] names no cluster; leave cluster out to "
                                     "run on this host"))
    for table in tables:
        problem = cluster_problem(table)
        if problem is None and kind == "slurm" and {"inter_gbps", "inter_latency_us"} & set(table):
            problem = ("under Slurm the links are the machine's: a cluster there takes "
                       "nodes and ranks_per_node only")
        if problem:
            raise ValueError(("cluster", problem))
    keys = ("nodes", "ranks_per_node") if kind == "slurm" else CLUSTER_KEYS
    filled = [{k: table.get(k, CLUSTER_KEYS[k][0]) for k in keys} for table in tables]
    return launcher, filled


def describe_cluster(c):
    """'2 hosts x 2 ranks, 1 Gbit/s' (+ latency when there is some); no link for Slurm's."""
    def count(n, what):
        return f"{n} {what}" + ("s" if n != 1 else "")
    text = f"{count(c['nodes'], 'host')} x {count(c['ranks_per_node'], 'rank')}"
    if "inter_gbps" in c:
        text += f", {c['inter_gbps']:g} Gbit/s"
    return text + (f", {c['inter_latency_us']:g} us" if c.get("inter_latency_us") else "")


def launch_params(params, launcher, cluster):
    """The point's params with its launch: nothing is added for the local launcher
    (so the points of older sweeps keep their ids); otherwise "launcher", the
    cluster, and the world size the cluster implies."""
    if launcher == "local" and cluster is None:
        return params
    out = dict(params, launcher=launcher)
    if cluster is not None:
        out["cluster"] = cluster
        out.setdefault("world_size", cluster["nodes"] * cluster["ranks_per_node"])
    return out


def launch_problem(command, p):
    """None, or (key, reason) for a point its launcher cannot run."""
    launcher, cluster = p.get("launcher", "local"), p.get("cluster")
    kind = launcher.split(":")[0]
    if command == "experiments.calibrate" and cluster is not None:
        if cluster["nodes"] < 2:                 # else the cross-host calibration
            return "cluster", ("experiments.calibrate on a cluster measures the link "
                               "between hosts: it needs nodes >= 2")
    elif kind != "local" and command not in MPI_COMMANDS:
        return "launcher", (f"{command} starts its own processes on this host: it runs with "
                            f"launcher = \"local\" only, or on a cluster of 2 hosts or more "
                            f"(experiments.calibrate), not {launcher!r}")
    if cluster is not None and kind in ("local", "hostfile"):
        return "cluster", (f"a cluster runs with launcher = \"emulated\" (or \"slurm\"), not "
                           f"{launcher!r}")
    if kind == "emulated" and cluster is None:
        return "launcher", ("launcher = \"emulated\" needs a cluster = {nodes = N, "
                            "ranks_per_node = R, inter_gbps = G}")
    if kind == "emulated" and emulated(p):
        key = "link_gbps" if p.get("link_gbps") else "link_latency_us"
        return key, ("the emulated cluster shapes its own links: give inter_gbps and "
                     "inter_latency_us in the cluster, not link_gbps / link_latency_us")
    if cluster is not None:
        N, R = cluster["nodes"], cluster["ranks_per_node"]
        if p.get("world_size") != N * R:
            return "world_size", (f"world_size {p.get('world_size')} disagrees with the "
                                  f"cluster: nodes({N}) x ranks_per_node({R}) = {N * R}")
    return None


@dataclass(frozen=True)
class ClusterPlace:
    """Where the sweep's emulated clusters live: the prefix of their namespace and link
    names, their private subnet, and the cluster tool's state directory
    ($TOPOLAB_CLUSTER_DIR, else one named after the prefix).  Each must differ from
    those of any other cluster up on this machine: the cluster tool removes whatever
    carries its prefix or is recorded in its directory, and refuses a subnet in use."""
    prefix: str = "ts-"
    subnet: str = "10.77.128.0/24"
    run_dir: str = ""

    def __post_init__(self):
        if not self.run_dir:
            default = os.path.join(tempfile.gettempdir(), f"topolab-sweep-{self.prefix}cluster")
            object.__setattr__(self, "run_dir", os.environ.get("TOPOLAB_CLUSTER_DIR") or default)

    def env(self):
        return {"TOPOLAB_CLUSTER_DIR": self.run_dir}

    def lock_path(self):
        # One lock per prefix: two sweeps with one prefix would tear down each other's hosts.
        return os.path.join(tempfile.gettempdir(), f"topolab-cluster-{self.prefix}lock")


def head(command, p, place=None):
    """The argv up to the module's own flags: how the point's launcher starts `command`."""
    py = sys.executable
    P = str(p.get("world_size", 1))
    kind, _, hostfile = p.get("launcher", "local").partition(":")
    mpi_job = [py, "-m", "mpi4py", "-m", command]
    if kind == "emulated":
        c, place = p["cluster"], place or ClusterPlace()
        return [py, "-m", "experiments.cluster", "run", "--nodes", str(c["nodes"]),
                "--ranks-per-node", str(c["ranks_per_node"]),
                "--inter-gbps", f"{c['inter_gbps']:g}",
                "--inter-latency-us", f"{c['inter_latency_us']:g}",
                "--prefix", place.prefix, "--subnet", place.subnet, "--", command]
    if kind == "hostfile":
        return [mpiexec_path(), "-f", hostfile, "-n", P] + mpi_job
    if kind == "slurm":
        shape = [] if p.get("cluster") is None else [
            "-N", str(p["cluster"]["nodes"]),
            "--ntasks-per-node", str(p["cluster"]["ranks_per_node"])]
        # MPICH's ranks find each other through Slurm's PMI-2 server (srun --mpi=pmi2)
        srun = ["srun", "-n", P, *shape, "--mpi=pmi2", "--kill-on-bad-exit=1"] + mpi_job
        if os.environ.get("SLURM_JOB_ID"):
            return srun                      # a step of the allocation we are in
        return ["salloc", "-n", P, *shape] + srun
    return [mpiexec_path(), "-n", P] + mpi_job


def needs(points, place=None):
    """Problems (strings) that stop the sweep before its first point: what the launchers
    of its points need and this machine lacks, or a place no cluster can have."""
    kinds = {p.get("launcher", "local").split(":")[0] for _, p, *_ in points}
    problems = []
    if "emulated" in kinds:
        from experiments.cluster.net import ClusterError, Layout, require_privileges
        try:
            place = place or ClusterPlace()
            Layout(1, place.prefix, place.subnet)           # names and range it would use
            require_privileges()
        except ClusterError as e:
            problems.append(f"launcher \"emulated\": {e}")
    if "slurm" in kinds:
        wanted = ["srun"] + ([] if os.environ.get("SLURM_JOB_ID") else ["salloc"])
        missing = [t for t in wanted if shutil.which(t) is None]
        if missing:
            problems.append(f"launcher \"slurm\": {', '.join(missing)} not on PATH "
                            f"(Slurm's client commands)")
    return problems


class ClusterLock:
    """An exclusive lock on the place's prefix, held while a point's cluster is up.
    Waits (polling, so a stopping signal still stops the sweep) while another
    sweep holds it; `stopped()` says when to give up."""

    def __init__(self, place, stopped=lambda: False):
        self.place, self.stopped, self.file = place, stopped, None

    def __enter__(self):
        self.file = open(self.place.lock_path(), "w")
        said = False
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if self.stopped():
                    self.file.close()
                    raise InterruptedError("stopped while waiting for the cluster lock")
                if not said:
                    print(f"waiting for {self.place.lock_path()}: another sweep runs clusters "
                          f"named {self.place.prefix}*", flush=True)
                    said = True
                time.sleep(0.5)

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def leftovers(place):
    """Namespaces and links named with the place's prefix (none after a clean point)."""
    from experiments.cluster.net import ours
    namespaces, links = ours(place.prefix)
    return namespaces + links


def tear_down(place, log):
    """`python -m experiments.cluster down` for the place, its output into `log`: after
    a point that did not end cleanly (a timeout or a stop kills the tool before its
    own teardown finished)."""
    from experiments.cluster.state import state_path
    if not leftovers(place) and not os.path.exists(state_path(place.prefix, place.run_dir)):
        return
    argv = [sys.executable, "-m", "experiments.cluster", "down", "--prefix", place.prefix]
    with open(log, "a") as f:
        f.write("\n[sweep] $ " + shlex.join(argv) + "\n")
        f.flush()
        subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=120, cwd=ROOT,
                       env={**os.environ, **place.env(), "PYTHONPATH": checkout_pythonpath()})
