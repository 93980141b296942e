"""A lab 1 cheat that passed the check when ranks shared a machine's files: an
all-gather through files in /dev/shm (each rank writes its vector, waits for the
others' files, sums them), then zeros in ring-shaped chunks for t's byte count.
The sandboxed check must refuse it: no rank may write a file, and each rank has
a /dev/shm of its own."""
import os
import time

import numpy as np


def ring_allreduce(t, x):
    P, r, n = t.size, t.rank, len(x)
    mine = f"/dev/shm/lab1_cheat_{n}_{r}.npy"
    np.save(mine + ".tmp.npy", x)
    os.rename(mine + ".tmp.npy", mine)
    total = np.zeros(n)
    for k in range(P):
        theirs = f"/dev/shm/lab1_cheat_{n}_{k}.npy"
        while not os.path.exists(theirs):
            time.sleep(0.01)
        total += np.load(theirs)
    bounds = [(a[0], a[-1] + 1) if len(a) else (0, 0)
              for a in np.array_split(np.arange(n), P)]
    for step in range(2 * (P - 1)):
        s0, s1 = bounds[(r - step - 1) % P]
        r0, r1 = bounds[(r - step - 2) % P]
        t.sendrecv(np.zeros(s1 - s0), (r + 1) % P, np.empty(r1 - r0), (r - 1) % P)
    x[:] = total
    return x
