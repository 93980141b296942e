"""Who a cluster belongs to: its record on disk, its mark on the machine, its lock.

A cluster is the pieces named with its prefix (net.py), and those names are the
machine's, whoever runs the tool and wherever it keeps its files.  So three things,
each with one job:

    the record   RUN_DIR/PREFIX/state.json (beside the hostfile, the launcher and the
                 hosts file): what the cluster is, for `run` and `status` in that
                 directory.  One directory holds any number of clusters, one per prefix.
    the mark     the bridge's alias (`ip link set PREFIXbr alias JSON`): who made the
                 pieces, from which directory, and whether they are finished.  It lives
                 and dies with the pieces, so every directory sees the same one.
    the lock     an fcntl lock per prefix, machine-wide (LOCK_DIR): one command at a time
                 changes a cluster (up, down, the start of a job); and one for choosing a
                 subnet, so two clusters being made at once never take the same range.

A cluster is *live*, and `up` leaves it alone, while any of these holds: a process
runs inside one of its hosts (a job, or what a killed tool left running), its mark
says it is up (a finished `up`: it stays until `down`), or the process that is making
it or runs a job on a cluster of its own is alive.  Pieces with none of these are
*stale*, what a crash left, and the next `up` removes them.
"""
import contextlib
import errno
import fcntl
import json
import os
import time

from . import net

DEFAULT_DIR = "/tmp/topolab-cluster"
# Machine-wide (never $TMPDIR, which differs between users and sudo): the prefix is.
LOCK_DIR = "/run/lock" if os.path.isdir("/run/lock") else "/tmp"
LOCK_WAIT_S = 120.0          # the longest a command waits for another on the same prefix
MARK_BY = "topolab-cluster"
MARK_MAX = 255               # bytes of an interface alias (IFALIASZ less its NUL)
FILES = ("state.json", "hostfile", "launcher.sh", "hosts")
# The phases of a record and a mark: being made by its owner; up until `down`;
# made by `run --nodes` for one job, gone with its owner.
CREATING, UP, OWN_JOB = "creating", "up", "run --nodes"
RECORD_KEYS = ("nodes", "ranks_per_node", "inter_gbps", "inter_latency_us", "latency_by",
               "prefix", "subnet", "phase", "owner", "hostfile", "launcher", "mpiexec_pid")


def run_dir():
    return os.environ.get("TOPOLAB_CLUSTER_DIR") or DEFAULT_DIR


def cluster_dir(prefix, directory=None):
    """Where the files of the cluster named `prefix` live."""
    return os.path.join(directory or run_dir(), prefix)


def state_path(prefix, directory=None):
    return os.path.join(cluster_dir(prefix, directory), "state.json")


def recorded(directory=None):
    """The prefixes with a record in the directory."""
    directory = directory or run_dir()
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [n for n in names if os.path.isfile(state_path(n, directory))]


def load(prefix):
    """The record of `prefix` in this directory, None if there is none; ClusterError,
    naming the file and the way out, when it is unreadable or incomplete."""
    path = state_path(prefix)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise net.ClusterError(f"{path} is unreadable ({e}): `down --prefix {prefix}` "
                               f"removes it and the cluster's pieces") from None
    missing = [k for k in RECORD_KEYS if k not in record] if isinstance(record, dict) else \
        ["everything"]
    if missing:
        raise net.ClusterError(f"{path} lacks {', '.join(missing)} (a record of another "
                               f"version): `down --prefix {prefix}` removes it and the pieces")
    return record


def save(record):
    os.makedirs(cluster_dir(record["prefix"]), exist_ok=True)
    path = state_path(record["prefix"])
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)         # whole or not at all, whenever we are killed


def forget(prefix):
    """Remove the cluster's files from this directory (and the directory, once empty)."""
    for name in FILES + ("state.json.tmp",):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(cluster_dir(prefix), name))
    for directory in (cluster_dir(prefix), run_dir()):
        with contextlib.suppress(OSError):  # not empty: files someone else put there stay
            os.rmdir(directory)


# --- processes: alive, and the same process (a pid is reused once its process is gone)

def started_at(pid):
    """The start time of a running process (clock ticks since boot), None if it is gone
    or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else int(fields[19])


def me():
    return {"pid": os.getpid(), "start": started_at(os.getpid())}


def alive(owner):
    """Whether the process `owner` ({"pid", "start"}, as me() made it) still runs."""
    return isinstance(owner, dict) and owner.get("start") is not None and \
        started_at(owner.get("pid")) == owner["start"]


# --- the mark and what the machine says

def mark_of(record):
    """The bridge's alias for a record: its phase, its owner and its directory."""
    text = json.dumps({"by": MARK_BY, "phase": record["phase"], "owner": record["owner"],
                       "dir": os.path.abspath(run_dir())}, separators=(",", ":"))
    if len(text.encode()) > MARK_MAX:
        raise net.ClusterError(f"the cluster directory {os.path.abspath(run_dir())} is too long "
                               f"a path to mark the bridge with; set TOPOLAB_CLUSTER_DIR to a "
                               f"shorter one")
    return text


def live_reason(prefix):
    """(pieces, why): the names of the cluster's pieces on this machine, and why it is
    live (in words), or None when the pieces are stale (or there are none)."""
    namespaces, links = net.ours(prefix)
    mark = net.read_mark(prefix, MARK_BY)
    pieces = namespaces + links
    busy = {ns: pids for ns in namespaces if (pids := net.namespace_pids(ns))}
    where = f" (its files in {mark['dir']})" if mark and mark.get("dir") else ""
    if busy:
        shown = "; ".join(f"{ns}: {' '.join(map(str, pids[:4]))}"
                          + (" ..." if len(pids) > 4 else "") for ns, pids in busy.items())
        return pieces, f"a job runs on it{where}, processes {shown}"
    if mark and mark.get("phase") == UP:
        return pieces, f"it is up{where}"
    if mark and alive(mark.get("owner")):
        doing = "is bringing it up" if mark.get("phase") == CREATING else "runs a job on it"
        return pieces, f"`experiments.cluster` (pid {mark['owner']['pid']}) {doing}{where}"
    return pieces, None


def owner_words(record):
    """What the record's owner is doing, and whether it is still there, in words."""
    pid = record["owner"].get("pid") if isinstance(record["owner"], dict) else None
    if alive(record["owner"]):
        return f"{'being brought up' if record['phase'] == CREATING else 'in use'} by pid {pid}"
    return f"its {'`up`' if record['phase'] == CREATING else '`run --nodes`'} (pid {pid}) " \
           f"ended before {'it was made' if record['phase'] == CREATING else 'tearing it down'}"


# --- the locks

class Lock:
    """An exclusive fcntl lock on LOCK_DIR/topolab-cluster-NAME.lock.  The kernel lets
    it go when its holder dies, so a crash never leaves a cluster locked."""

    def __init__(self, name):
        self.path = os.path.join(LOCK_DIR, f"topolab-cluster-{name}.lock")
        self.fd = None

    def acquire(self, wait_s=LOCK_WAIT_S):
        # O_NOFOLLOW, no truncation: a link planted in a shared directory is refused.
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise net.ClusterError(f"cannot open the lock {self.path}: "
                                   f"{os.strerror(e.errno)}") from None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                self.release()
                raise net.ClusterError(f"another `experiments.cluster` has held {self.path} "
                                       f"for more than {wait_s:g} s; try again when it is done")
            time.sleep(0.1)

    def release(self):
        if self.fd is not None:
            os.close(self.fd)               # closing the last descriptor unlocks
            self.fd = None

    def __enter__(self):
        return self.acquire() if self.fd is None else self

    def __exit__(self, *exc):
        self.release()


def cluster_lock(prefix):
    """One command at a time changes the cluster named `prefix`."""
    return Lock(prefix.rstrip("-"))


def subnet_lock():
    """One cluster at a time chooses its subnet and takes it (the bridge's address)."""
    return Lock("subnets")
