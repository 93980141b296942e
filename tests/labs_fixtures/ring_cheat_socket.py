"""A lab 1 cheat: ranks meet on a TCP port of localhost and rank 0 sums.  The
sandboxed check must refuse it: no socket (and a network namespace of its own)."""
import socket

import numpy as np


def ring_allreduce(t, x):
    s = socket.socket()
    s.connect(("127.0.0.1", 29500))
    s.sendall(x.tobytes())
    x[:] = np.frombuffer(s.recv(x.nbytes), dtype=np.float64)
    return x
