"""Result records: where they live, how to read them, and the provenance each one carries.

A results directory (written by experiments.sweep) holds
    records.jsonl   every measurement, one JSON object a line, each with
                    "command", "point", "config" (the point's full config) and
                    "provenance" (commit, MPI, torch, host, load average)
    points.jsonl    one line per launched point: "status" ok | failed | timeout,
                    the return code, the wall time and the path of its log
    logs/POINT.log  the point's stdout and stderr
Plots and the report read records.jsonl only.
"""
import functools
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata

# JSON Lines have one home below every package; imported here for the readers of results.
from allreduce.records import append_jsonl, read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(root=ROOT):
    """HEAD's commit, read from .git itself (no git process needed); None outside a checkout."""
    git = os.path.join(root, ".git")
    try:
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if os.path.exists(os.path.join(git, ref)):
            with open(os.path.join(git, ref)) as f:
                return f.read().strip()
        with open(os.path.join(git, "packed-refs")) as f:
            for line in f:
                if line.strip().endswith(" " + ref):
                    return line.split()[0]
    except OSError:
        pass
    return None


def mpiexec_path():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else "mpiexec"


@functools.lru_cache(maxsize=1)
def mpi_version():
    """The MPI library's version line, asked of a one-rank job (not this process:
    importing mpi4py.MPI here would initialise MPI in the sweep driver)."""
    try:
        out = subprocess.run([mpiexec_path(), "-n", "1", sys.executable, "-c",
                              "from mpi4py import MPI; "
                              "print(MPI.Get_library_version().splitlines()[0].strip())"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def provenance():
    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None
    return {"commit": git_commit(), "host": socket.gethostname(), "mpi": mpi_version(),
            "torch": version("torch"), "numpy": version("numpy"), "mpi4py": version("mpi4py"),
            "python": platform.python_version(), "cores": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "env": tuning_env()}


# Settings that change what is measured without changing any command line:
# MPICH's and Open MPI's tuning variables (e.g. MPIR_CVAR_CH4_CMA_ENABLE=0 turns
# MPICH's single-copy path off) and our own switches.
TUNING_PREFIXES = ("MPIR_CVAR_", "OMPI_MCA_", "TOPOLAB_", "OMP_NUM_THREADS")


def tuning_env():
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(TUNING_PREFIXES)}


def load(results_dir):
    """Every measurement record of a results directory."""
    return read_jsonl(os.path.join(results_dir, "records.jsonl"))


def of_command(records, command, **match):
    """The records of one command whose fields equal `match`."""
    return [r for r in records if r.get("command") == command
            and all(r.get(k) == v for k, v in match.items())]
