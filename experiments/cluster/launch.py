"""Launching a job across the emulated hosts with MPICH's process manager (hydra).

    mpiexec -f HOSTFILE -n N*R -launcher ssh -launcher-exec LAUNCHER -iface BRIDGE \\
        python -m mpi4py -m MODULE ARGS...

mpiexec stays in the root namespace and listens on the bridge's address.  For
each host it runs `LAUNCHER [ssh options] HOST COMMAND...`, as it would run ssh;
the launcher drops the options and runs COMMAND (hydra's proxy, which starts
that host's ranks) inside HOST's namespace with a hostname of its own:

    ip netns exec HOST unshare --uts --mount sh -c \\
        "mount --bind RUN_DIR/hosts /etc/hosts && hostname HOST && exec COMMAND"

Two settings make the hosts real to MPICH:
  * a hostname per host (a UTS namespace): MPICH groups ranks into nodes by host
    name, so without it every rank shares memory with every other one (and the
    hosts file makes each name resolve to its host's address, as on a real
    cluster: parameter servers advertise tcp://HOSTNAME:PORT);
  * MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp: UCX, MPICH's default network module,
    finds the other namespaces' ranks through shared memory and would bypass the
    links.  With libfabric's TCP provider, ranks on one host use shared memory
    and ranks on different hosts use TCP over the shaped link.
The rank environment is written into the launcher (hydra also forwards
mpiexec's own environment to the ranks, -genvall being its default; the
launcher's copy makes the proxy's environment right whatever mpiexec forwards).
"""
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time

from allreduce.records import checkout_pythonpath

from .net import HOST_IF

NETMOD_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": HOST_IF,
              # torch.distributed: gloo would advertise the address of the host name,
              # which no namespace resolves (it falls back to 127.0.0.1)
              "GLOO_SOCKET_IFNAME": HOST_IF, "NCCL_SOCKET_IFNAME": HOST_IF}
GRACE_S = 5.0                    # after SIGTERM, before SIGKILL


def rank_env(layout):
    """What every rank needs: the venv on PATH, the checkout on PYTHONPATH, the
    MPICH netmod, and rank 0's address for torch.distributed's rendezvous."""
    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "/usr/bin:/bin")
    return {"PATH": bin_dir + os.pathsep + path,
            "PYTHONPATH": checkout_pythonpath(),
            "PYTHONUNBUFFERED": "1",
            "TOPOLAB_MASTER_ADDR": layout.address(0),
            **NETMOD_ENV}


def write_files(run_dir, layout, ranks_per_node):
    """The hostfile and the launcher script; returns their paths."""
    hostfile = os.path.join(run_dir, "hostfile")
    with open(hostfile, "w") as f:
        f.writelines(f"{layout.host(i)}:{ranks_per_node}\n" for i in range(layout.nodes))
    # Name resolution, as a real cluster has it: the hosts file is bound over
    # /etc/hosts in each host's own mount namespace (nothing in /etc changes).
    hosts_file = os.path.join(run_dir, "hosts")
    with open(hosts_file, "w") as f:
        f.write("127.0.0.1 localhost\n::1 localhost\n")
        f.writelines(f"{layout.address(i)} {layout.host(i)}\n" for i in range(layout.nodes))
    hosts = "|".join(layout.host(i) for i in range(layout.nodes))
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in rank_env(layout).items())
    launcher = os.path.join(run_dir, "launcher.sh")
    with open(launcher, "w") as f:
        f.write(f"""#!/bin/sh
# hydra calls: launcher.sh [ssh options] HOST COMMAND...  (COMMAND is quoted for a shell)
while [ $# -gt 0 ]; do
    case "$1" in -x|-q|-T|-n|-t) shift ;; -o|-p|-l|-i) shift 2 ;; *) break ;; esac
done
host=$1; shift
case "$host" in
    {hosts}) ;;
    *) echo "launcher.sh: $host is not a host of this cluster" >&2; exit 2 ;;
esac
{exports}exec ip netns exec "$host" unshare --uts --mount sh -c \\
    "mount --bind {shlex.quote(hosts_file)} /etc/hosts && hostname $host && exec $*"
""")
    os.chmod(launcher, 0o755)
    return hostfile, launcher


def job_command(layout, ranks_per_node, hostfile, launcher, job):
    """mpiexec across the hosts, R ranks each in blocks; `job` is MODULE ARGS or SCRIPT.py ARGS."""
    from experiments.records import mpiexec_path     # imports torch: only when a job runs
    target = [job[0]] if job[0].endswith(".py") else ["-m", job[0]]
    return [mpiexec_path(), "-f", hostfile, "-n", str(layout.nodes * ranks_per_node),
            "-launcher", "ssh", "-launcher-exec", launcher, "-iface", layout.bridge,
            sys.executable, "-m", "mpi4py", *target, *job[1:]]


class Interrupted(Exception):
    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_raise():
    """Inside: SIGINT, SIGTERM and SIGHUP raise Interrupted, so `finally` blocks
    (ending the job, tearing the cluster down) run before the tool exits."""
    def interrupt(signum, frame):
        for s in previous:                  # a second Ctrl-C must not cut the teardown short
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)
    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM,
                                                         signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_job(cmd, env, started):
    """Run mpiexec in a session of its own (Ctrl-C reaches the tool only, which
    ends the job in order); `started(pid)` records it.  Returns its exit code;
    if interrupted, ends the job (SIGTERM, then SIGKILL) before passing it on."""
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True)
    try:
        started(proc.pid)
        return proc.wait()
    finally:
        if proc.poll() is None:
            stop_group(proc.pid, proc.wait)


def stop_group(pgid, wait=None):
    """SIGTERM the process group (hydra passes it to the ranks), SIGKILL after GRACE_S."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        if wait is not None:
            try:
                wait(timeout=0.1)
                return
            except subprocess.TimeoutExpired:
                continue
        if not os.path.exists(f"/proc/{pgid}"):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if wait is not None:
        wait()


def is_our_mpiexec(pid):
    """Whether pid still is the mpiexec this tool started (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return bool(argv) and os.path.basename(argv[0]).startswith(b"mpiexec") \
        and b"-launcher-exec" in argv
