"""A lab 1 cheat, subtler than the oracle: it sends what an honest ring would send
if the inputs were the pattern the sheet once documented (arange(n) +
1000 (rank + 1)), partial sums and all, and returns the pattern's sum.  The
check must refuse it: with random inputs its messages are values no element
sums to."""
import numpy as np


def ring_allreduce(t, x):
    P, r, n = t.size, t.rank, len(x)
    guess = lambda k: np.arange(n) + 1000.0 * (k + 1)       # noqa: E731
    bounds = [(a[0], a[-1] + 1) if len(a) else (0, 0)
              for a in np.array_split(np.arange(n), P)]
    for step in range(P - 1):                               # partial sums of ranks r-step..r
        s0, s1 = bounds[(r - step - 1) % P]
        r0, r1 = bounds[(r - step - 2) % P]
        fake = sum(guess((r - i) % P) for i in range(step + 1))[s0:s1]
        t.sendrecv(np.ascontiguousarray(fake), (r + 1) % P, np.empty(r1 - r0), (r - 1) % P)
    total = sum(guess(k) for k in range(P))
    for step in range(P - 1):
        s0, s1 = bounds[(r - step) % P]
        r0, r1 = bounds[(r - step - 1) % P]
        t.sendrecv(np.ascontiguousarray(total[s0:s1]), (r + 1) % P, np.empty(r1 - r0),
                   (r - 1) % P)
    x[:] = total
    return x
