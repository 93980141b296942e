"""JSON Lines: the one place results are appended and read back.

Every benchmark, the trainer, the sweep, the calibration and the simulator write
their records through `append_jsonl`, and every reader goes through `read_jsonl`.
It lives in the lowest package so allreduce, psrv, strategies and experiments can
all import it without importing upward.

Why a helper at all: a writer killed mid-line leaves a torn last line with no
newline.  A plain `open(path, "a").write(line)` would glue the next record onto
that fragment, and the reader would lose both.  So an append first looks at the
file's last byte and starts on a fresh line when it is not a newline; the reader
skips a line that does not parse (the torn fragment) and says how many it skipped.

Provenance, too, has its home here: `provenance()` is what every record writer
stamps on its records (commit, host, MPI, python, torch, ...), and
`calibration_file` is how every reader of a calibration finds it.
"""
import functools
import json
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALIBRATION = "calibration.json"    # what `experiments.calibrate --out DIR` writes in DIR


def checkout_pythonpath():
    """PYTHONPATH for a child process: this checkout first, so it imports the
    packages from here wherever it runs, then whatever PYTHONPATH was already."""
    pythonpath = os.environ.get("PYTHONPATH", "")
    return ROOT + (os.pathsep + pythonpath if pythonpath else "")


def append_jsonl(path, records):
    """Append `records` (dicts), one JSON object a line, starting on a fresh line.

    The lines go out in one write on a file opened for appending (O_APPEND), so
    two processes appending small records to one file do not interleave mid-line."""
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    if not data:
        return
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size > 0:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                data = b"\n" + data
        f.write(data)


def rewrite_jsonl(path, records):
    """Replace `path` with exactly `records`: written to a temporary file beside it,
    then renamed over it (atomic), so a crash leaves the old file or the new one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def scan_jsonl(path):
    """(records, bad_lines): the JSON objects of `path` in order, and the 1-based
    numbers of the non-empty lines that are not a JSON object (a torn write).
    A missing file has no records."""
    records, bad = [], []
    if not os.path.exists(path):
        return records, bad
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = None
            if isinstance(record, dict):
                records.append(record)
            else:
                bad.append(number)
    return records, bad


def read_jsonl(path, warn=True):
    """The records of `path`; a torn line is skipped and, when `warn`, reported on stderr."""
    records, bad = scan_jsonl(path)
    if bad and warn:
        shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
        print(f"warning: {path}: skipped {len(bad)} unreadable line(s) (line {shown}); "
              f"a writer was probably killed mid-write", file=sys.stderr)
    return records


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
    """The mpiexec beside this Python (the virtualenv's MPICH), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else "mpiexec"


@functools.lru_cache(maxsize=1)
def mpi_version():
    """The MPI library's version line.  A process already in MPI (it imported
    mpi4py.MPI, which initialises it) asks its own library; any other (a sweep's
    driver) asks a one-rank job, so that it does not initialise MPI itself, and
    no rank of a job starts an mpiexec of its own."""
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI
        return MPI.Get_library_version().splitlines()[0].strip()
    try:
        out = subprocess.run([mpiexec_path(), "-n", "1", sys.executable, "-c",
                              "from mpi4py import MPI; "
                              "print(MPI.Get_library_version().splitlines()[0].strip())"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# Settings that change what is measured without changing any command line:
# MPICH's and Open MPI's tuning variables (e.g. MPIR_CVAR_CH4_CMA_ENABLE=0 turns
# MPICH's single-copy path off) and our own switches.
TUNING_PREFIXES = ("MPIR_CVAR_", "OMPI_MCA_", "TOPOLAB_", "OMP_NUM_THREADS")


def tuning_env():
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(TUNING_PREFIXES)}


def package_version(name):
    """An installed package's version without importing it (torch takes seconds)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def provenance():
    """Where and on what a record was measured: the fields every record writer stamps."""
    return {"commit": git_commit(), "host": socket.gethostname(), "mpi": mpi_version(),
            "torch": package_version("torch"), "numpy": package_version("numpy"),
            "mpi4py": package_version("mpi4py"), "python": platform.python_version(),
            "cores": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "env": tuning_env()}


def calibration_file(path):
    """The calibration that `path` names: the file itself, or DIR/calibration.json of
    the directory `experiments.calibrate --out DIR` wrote; FileNotFoundError otherwise."""
    file = os.path.join(path, CALIBRATION) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        where = f"directory {path!r} has no {CALIBRATION}" if os.path.isdir(path) \
            else f"{path!r} does not exist"
        raise FileNotFoundError(f"calibration: {where}; write one with "
                                f"`python -m experiments.calibrate --out DIR`")
    return file


def read_calibration(path):
    """The calibration (a dict) of a file or of a directory holding calibration.json."""
    with open(calibration_file(path)) as f:
        return json.load(f)


def write_calibration(directory, calibration):
    """Write DIR/calibration.json (DIR created if missing), atomically; returns its path."""
    if directory.endswith(".json"):
        raise ValueError(f"--out {directory!r}: --out names a directory, into which "
                         f"{CALIBRATION} is written; give e.g. --out results")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CALIBRATION)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(calibration, f, indent=1)
    os.replace(tmp, path)
    return path
