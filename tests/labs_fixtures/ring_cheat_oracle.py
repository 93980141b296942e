"""A lab 1 cheat that passed the check while its inputs were documented
(arange(n) + 1000 (rank + 1) on every rank): it moves no data, works the sum out
from the pattern, and sends zeros in ring-shaped chunks.  The check must refuse
it: the inputs are random now, and zeros are no ring's message."""
import numpy as np


def ring_allreduce(t, x):
    P, r, n = t.size, t.rank, len(x)
    bounds = [(a[0], a[-1] + 1) if len(a) else (0, 0)
              for a in np.array_split(np.arange(n), P)]
    for step in range(2 * (P - 1)):
        s0, s1 = bounds[(r - step - 1) % P]
        r0, r1 = bounds[(r - step - 2) % P]
        t.sendrecv(np.zeros(s1 - s0), (r + 1) % P, np.empty(r1 - r0), (r - 1) % P)
    x[:] = np.arange(n) * P + 1000.0 * P * (P + 1) / 2
    return x
