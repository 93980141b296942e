"""CURVE keys for psrv: files for a standalone launch, or made in memory under mpiexec.

    python -m psrv.keys DIR --workers N

writes, in ZeroMQ's certificate format (what zmq.auth.load_certificate reads),
every file 0600 in 0700 directories:

    DIR/server.key                 the servers' public key
    DIR/server.key_secret          the servers' keypair          -> server hosts only
    DIR/workers/worker-I.key       worker I's public key         -> server hosts
    DIR/workers/worker-I.key_secret  worker I's keypair          -> worker I's host only

A server started with `--keys DIR` reads server.key_secret and admits exactly the
public keys in DIR/workers/worker-I.key, each for worker I alone: the file's name
binds the key to its worker id, so a key can only ever speak for its own worker
(a file of any other name, or one key under two ids, is refused).  Worker I
(`psrv.example --keys DIR`) reads server.key and workers/worker-I.key_secret.
On a shared file system all read DIR.  A secret file that group or others may
read is refused, as ssh refuses one.

Under mpiexec no files are needed: `for_mpi_rank` has every rank make its own
keypair (zmq.curve_keypair, libsodium) and gathers the public keys only, so no
secret ever leaves the process that made it.

CurveZMQ (RFC 26) authenticates and encrypts each connection with per-connection
session keys, which is why a captured frame replayed on a new connection is
worthless; the server's allow-list is its ZAP handler (RFC 27, auth.py).
"""
import argparse
import os
import re
import struct
import types
from dataclasses import dataclass

import zmq
import zmq.auth
import zmq.utils.z85

KEY_LENGTH = 40                          # a Z85-encoded 32-byte Curve25519 key
WORKER_FILE = re.compile(r"worker-(0|[1-9][0-9]*)\.key")     # the name binds the key to id I


def check_key(key, what):
    """A Z85 text key (bytes or str) -> bytes, or ValueError naming what is wrong."""
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, bytes) or len(key) != KEY_LENGTH:
        raise ValueError(f"{what}: expected a {KEY_LENGTH}-character Z85 CURVE key, got "
                         f"{len(key) if isinstance(key, (bytes, str)) else type(key).__name__}"
                         f"{' characters' if isinstance(key, (bytes, str)) else ''}")
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, KeyError, TypeError, struct.error):
        raise ValueError(f"{what}: not a Z85 key") from None
    return key


@dataclass(frozen=True)
class ServerKeys:
    """A server's keypair and the workers' public keys it admits: clients maps each
    public key to the one worker id it may speak for, or to None: the first id it
    speaks for (auth.Members), for keys that never leave one MPI job's processes."""
    public: bytes
    secret: bytes
    clients: dict

    def __post_init__(self):
        object.__setattr__(self, "public", check_key(self.public, "server public key"))
        object.__setattr__(self, "secret", check_key(self.secret, "server secret key"))
        if not hasattr(self.clients, "items"):
            raise ValueError(f"ServerKeys.clients must map each public key to its worker id, "
                             f"got {type(self.clients).__name__}")
        clients = {}
        for key, worker in self.clients.items():
            key = check_key(key, f"client public key of worker {worker}")
            if worker is not None and (not isinstance(worker, int) or worker < 0):
                raise ValueError(f"client key {key.decode()}: worker id {worker!r} is not "
                                 f"an int >= 0")
            if worker is None:
                clients.setdefault(key, None)
            elif clients.setdefault(key, worker) != worker:
                raise ValueError(f"client key {key.decode()} is given for worker "
                                 f"{clients[key]} and worker {worker}: a key is one worker's")
        if not clients:
            raise ValueError("ServerKeys with no client key would admit nobody")
        object.__setattr__(self, "clients", types.MappingProxyType(clients))

    def __repr__(self):                  # never print the secret
        return f"ServerKeys(public={self.public.decode()}, {len(self.clients)} clients)"


@dataclass(frozen=True)
class ClientKeys:
    """A worker's keypair and the servers' public key(s): one for all, or one per endpoint."""
    public: bytes
    secret: bytes
    servers: tuple

    def __post_init__(self):
        object.__setattr__(self, "public", check_key(self.public, "client public key"))
        object.__setattr__(self, "secret", check_key(self.secret, "client secret key"))
        servers = (self.servers,) if isinstance(self.servers, (bytes, str)) else self.servers
        servers = tuple(check_key(s, "server public key") for s in servers)
        if not servers:
            raise ValueError("ClientKeys needs the servers' public key")
        object.__setattr__(self, "servers", servers)

    def server(self, i):
        return self.servers[i if len(self.servers) > 1 else 0]

    def __repr__(self):
        return f"ClientKeys(public={self.public.decode()}, {len(self.servers)} server keys)"


# -- files ------------------------------------------------------------------------
def _write(path, public, secret=None):
    """One certificate in zmq's format, created 0600 (O_EXCL: never overwrite a key)."""
    kind = "Secret" if secret else "Public"
    lines = [f"#   ZeroMQ CURVE **{kind}** Certificate (psrv.keys)",
             "#   Keep secret certificates 0600 and on the hosts that need them.", "",
             "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def _write_pair(base):
    public, secret = zmq.curve_keypair()
    _write(base + ".key", public)
    _write(base + ".key_secret", public, secret)


def generate(directory, num_workers):
    """Write a server keypair and num_workers worker keypairs under directory.  Every
    check comes before anything is touched: an existing directory keeps its mode."""
    if num_workers < 1:
        raise ValueError(f"need at least one worker key, got {num_workers}")
    workers = os.path.join(directory, "workers")
    for d in (directory, workers):
        if os.path.lexists(d) and not os.path.isdir(d):
            raise ValueError(f"{d} exists and is not a directory")
    bases = [os.path.join(directory, "server")] + [os.path.join(workers, f"worker-{w}")
                                                   for w in range(num_workers)]
    there = [b + end for b in bases for end in (".key", ".key_secret") if os.path.lexists(b + end)]
    if there:
        more = f" (and {len(there) - 1} more key files)" if len(there) > 1 else ""
        raise ValueError(f"{there[0]} exists{more}: keys are never overwritten")
    for d in (directory, workers):
        if not os.path.isdir(d):
            os.mkdir(d, 0o700)
            os.chmod(d, 0o700)            # what we create is 0700 whatever the umask
    for base in bases:
        _write_pair(base)


def _load(path, secret):
    if not os.path.exists(path):
        raise ValueError(f"key file {path} does not exist (make keys with python -m psrv.keys DIR)")
    if not os.path.isfile(path):
        raise ValueError(f"key file {path} is not a regular file")
    if secret and os.stat(path).st_mode & 0o077:
        raise ValueError(f"secret key file {path} may be read by group or others: chmod 600 {path}")
    try:
        public, sec = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"key file {path}: {e}") from None
    if secret and not sec:
        raise ValueError(f"key file {path} holds no secret key")
    return public, sec


def load_server_keys(directory):
    """DIR/server.key_secret and every DIR/workers/worker-I.key, the key of worker I."""
    public, secret = _load(os.path.join(directory, "server.key_secret"), secret=True)
    workers = os.path.join(directory, "workers")
    try:
        names = sorted(n for n in os.listdir(workers) if n.endswith(".key"))
    except OSError as e:
        raise ValueError(f"worker keys: {workers}: {e.strerror}") from None
    if not names:
        raise ValueError(f"no worker public keys in {workers}/worker-I.key")
    clients = {}
    for name in names:
        match = WORKER_FILE.fullmatch(name)
        if match is None:
            raise ValueError(f"{os.path.join(workers, name)}: a worker key file is named "
                             f"worker-I.key, which binds it to worker I")
        key = _load(os.path.join(workers, name), secret=False)[0]
        if key in clients:
            raise ValueError(f"{os.path.join(workers, name)} holds the key of worker "
                             f"{clients[key]} too: a key is one worker's")
        clients[key] = int(match.group(1))
    return ServerKeys(public, secret, clients)


def load_worker_keys(directory, worker_id):
    """DIR/server.key and DIR/workers/worker-I.key_secret."""
    server, _ = _load(os.path.join(directory, "server.key"), secret=False)
    public, secret = _load(os.path.join(directory, "workers", f"worker-{worker_id}.key_secret"),
                           secret=True)
    return ClientKeys(public, secret, (server,))


# -- under mpiexec ------------------------------------------------------------------
def for_mpi_rank(comm, num_workers):
    """Collective: ranks < num_workers are workers, the rest servers.  -> this rank's
    ClientKeys or ServerKeys.  Only public keys travel (one 40-byte Allgather).

    A key made here never leaves the job's processes, and the worker id it will speak
    for is not known yet (the hybrid sync's node leaders speak for their index among
    the leaders, decided after this exchange), so each binds to the first id it speaks for."""
    import numpy as np
    public, secret = zmq.curve_keypair()
    publics = np.empty((comm.Get_size(), KEY_LENGTH), np.uint8)
    comm.Allgather(np.frombuffer(public, np.uint8), publics)
    keys = [bytes(row) for row in publics]
    if comm.Get_rank() < num_workers:
        return ClientKeys(public, secret, tuple(keys[num_workers:]))
    return ServerKeys(public, secret, dict.fromkeys(keys[:num_workers]))


def main(argv=None):
    ap = argparse.ArgumentParser(description="write CURVE keys for psrv servers and workers")
    ap.add_argument("directory")
    ap.add_argument("--workers", type=int, required=True, help="how many worker keypairs")
    a = ap.parse_args(argv)
    try:
        generate(a.directory, a.workers)
    except ValueError as e:
        ap.exit(2, f"psrv.keys: {e}\n")
    except OSError as e:
        ap.exit(2, f"psrv.keys: {e.filename or a.directory}: {e.strerror}\n")
    print(f"psrv.keys: wrote {a.directory}/server.key[_secret] and "
          f"{a.workers} keypairs in {a.directory}/workers/")


if __name__ == "__main__":
    main()
