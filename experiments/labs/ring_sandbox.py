"""One rank of lab 1's check: a process whose only channel is the lab's transport.

    python -m experiments.labs.ring_sandbox RANK SIZE IN OUT DUMP   (ring_network starts it)

It reads from the check on fd IN, writes to it on fd OUT, and writes a stack dump
to fd DUMP when the rank has run its own code for HANG_S seconds without calling t.  stdout and
stderr go to the check, which prints them prefixed with the rank.

How it is sandboxed (both layers, so that neither alone is trusted):
  namespaces   where the check may (root, or unprivileged user namespaces), the
               process runs under `unshare` with its own mount, network, IPC and
               PID namespaces: a /dev/shm and a /tmp of its own (empty tmpfs), no
               network but its own loopback, no other rank's process in /proc.
  audit hook   before the student's file is run (PEP 578; it cannot be removed):
               no file opened for writing, no file read from /dev/shm or another
               process's /proc, no socket, no subprocess, fork or exec, no signal
               to another process, no shared memory, no ctypes or cffi, no mpi4py,
               no walk of the garbage collector's objects (to reach the hook).
No MPI variable is in its environment, and it inherits no file but its pipes.
"""
import faulthandler
import linecache
import os
import sys
import traceback

import numpy as np

from .ring_transport import CheckQuit, LabTransport, Op, read, write

HANG_S = 10.0
HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
PLAIN = 1            # a RAISED message whose text is a sentence, not a traceback
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
BLOCKED_IMPORTS = ("mpi4py", "ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixshmem",
                   "multiprocessing", "_multiprocessing", "socket", "_socket", "mmap")
BLOCKED_EVENTS = {
    "socket.__new__": "sockets", "socket.bind": "sockets", "socket.connect": "sockets",
    "os.system": "shell commands", "os.exec": "exec", "os.posix_spawn": "new processes",
    "os.spawn": "new processes", "os.fork": "fork", "os.forkpty": "fork",
    "subprocess.Popen": "subprocesses", "os.kill": "signals", "os.killpg": "signals",
    "signal.pthread_kill": "signals", "mmap.__new__": "shared memory",
    "ctypes.dlopen": "ctypes", "ctypes.dlsym": "ctypes", "ctypes.call_function": "ctypes",
    "ctypes.cdata": "ctypes", "gc.get_objects": "walks over the garbage collector's objects",
    "gc.get_referrers": "walks over the garbage collector's objects",
    "gc.get_referents": "walks over the garbage collector's objects",
    "sys._current_frames": "other threads' frames", "os.link": "new files",
    "os.symlink": "new files", "os.rename": "renamed files", "os.remove": "removed files",
    "os.mkdir": "new directories", "os.truncate": "file changes", "os.utime": "file changes",
    "os.chmod": "file changes", "os.setxattr": "file changes",
}


class Refused(PermissionError):
    """What the sandbox refuses; the ring sees it as any other error."""


def private_mounts():
    """In a mount namespace of its own: an empty tmpfs on /dev/shm and /tmp (not on
    /tmp if this program lives there).  Silently nothing outside a namespace."""
    if os.environ.get("TOPOLAB_RING_NAMESPACES") != "1":
        return []
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    here = os.path.realpath(__file__)
    done = []
    for where in ("/dev/shm", "/tmp", "/var/tmp"):
        if here.startswith(where + "/") or os.path.realpath(sys.prefix).startswith(where + "/"):
            continue
        if os.path.isdir(where) and libc.mount(b"none", where.encode(), b"tmpfs", 0, None) == 0:
            done.append(where)
    del sys.modules["ctypes"]
    return done


def install_hook():
    """The audit hook; from here on the process is the student's."""
    sys.dont_write_bytecode = True
    blocked, events = BLOCKED_IMPORTS, dict(BLOCKED_EVENTS)
    self_proc = (f"/proc/{os.getpid()}/", "/proc/self/", "/proc/thread-self/")

    def hook(event, args):
        if event == "open":
            path, mode, flags = (list(args) + [None, None, 0])[:3]
            path = os.fsdecode(path) if isinstance(path, (str, bytes)) else ""
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & WRITE_FLAGS)
            if writing:
                raise Refused(f"the lab's sandbox: no file may be written ({path!r}); a ring "
                              f"moves data only with t.sendrecv")
            real = os.path.abspath(path) if path else ""
            if real.startswith("/dev/shm") or (real.startswith("/proc/") and real[6:7].isdigit()
                                               and not real.startswith(self_proc)):
                raise Refused(f"the lab's sandbox: {path!r} is not readable here; a ring moves "
                              f"data only with t.sendrecv")
        elif event == "import":
            name = str(args[0])
            if name.split(".")[0] in blocked:
                raise Refused(f"the lab's sandbox has no {name}: your ring may use numpy and "
                              f"t (t.rank, t.size, t.sendrecv), nothing else")
        elif event in events:
            raise Refused(f"the lab's sandbox refuses {events[event]} ({event}): a ring moves "
                          f"data only with t.sendrecv")

    sys.addaudithook(hook)


def student_traceback(error, path):
    """The traceback from the student's first frame on."""
    frames = traceback.extract_tb(error.__traceback__)
    first = next((i for i, f in enumerate(frames) if f.filename == path), 0)
    frames = [f for f in frames[first:] if not f.filename.startswith(HERE)]
    return "".join(["Traceback (most recent call last):\n", *traceback.format_list(frames),
                    *traceback.format_exception_only(type(error), error)])


def load(source, path):
    """The student's module as a dict: its text compiled under its own path, its
    lines in linecache so that tracebacks show them (the file itself may sit in a
    /tmp this process cannot see)."""
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    namespace = {"__name__": "student_ring", "__file__": path, "__builtins__": __builtins__}
    exec(compile(source, path, "exec"), namespace)
    return namespace


def main():
    rank, size, from_check, to_check, dump = (int(a) for a in sys.argv[1:6])

    def arm(waiting):
        """Dump the stack to fd `dump` if the ring runs its own code for HANG_S seconds."""
        if waiting:
            faulthandler.cancel_dump_traceback_later()
        else:
            faulthandler.dump_traceback_later(HANG_S, repeat=False, file=dump)

    private_mounts()
    message = read(from_check)
    if message is None or message.op != Op.SOURCE:
        return 2
    path, source = message.payload[:message.recv_count], message.payload[message.recv_count:]
    install_hook()
    try:
        ring = load(source, path).get("ring_allreduce")
    except BaseException as e:          # noqa: BLE001 - the student's file may raise anything
        write(to_check, Op.RAISED, student_traceback(e, path), call=-1)
        return 1
    write(to_check, Op.LOADED, call=int(callable(ring)))
    t = LabTransport(rank, size, to_check, from_check, on_call=arm)
    while True:
        message = read(from_check)
        if message is None or message.op != Op.INPUT:
            return 0
        x = message.payload
        t.calls = 0
        arm(False)
        try:
            out = ring(t, x)
        except CheckQuit:
            return 0
        except SystemExit as e:
            write(to_check, Op.RAISED, f"exited with status {e.code!r} (sys.exit) inside the "
                  f"ring", call=t.calls, dest=PLAIN)
            return 0
        except BaseException as e:      # noqa: BLE001
            write(to_check, Op.RAISED, student_traceback(e, path), call=t.calls)
            return 0
        finally:
            arm(True)
        out = x if out is None else out
        try:
            out = np.asarray(out, dtype=np.float64).ravel() if np.ndim(out) == 1 else None
        except (TypeError, ValueError):
            out = None
        if out is None:
            write(to_check, Op.RAISED, "returned something that is not a 1-D array of numbers",
                  call=t.calls, dest=PLAIN)
            return 0
        write(to_check, Op.RESULT, out, call=t.calls)


if __name__ == "__main__":
    sys.exit(main())
