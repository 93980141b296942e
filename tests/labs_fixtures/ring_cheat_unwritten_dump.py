"""A lab 1 cheat: each rank appends its vector to a file in the working
directory (no /dev/shm needed) and reads the others'.  The sandboxed check must
refuse it: no file may be opened for writing."""
import numpy as np


def ring_allreduce(t, x):
    with open(f"lab1_ranks_{len(x)}.bin", "ab") as f:
        f.write(x.tobytes())
    return x
