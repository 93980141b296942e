"""A lab 1 cheat: read the check's memory map under /proc (its parent), hunting
for the inputs or their seed.  The sandboxed check must refuse it: no other
process's /proc is readable (and in its PID namespace there is none to see)."""
import os


def ring_allreduce(t, x):
    with open(f"/proc/{os.getppid()}/maps") as f:
        f.read()
    return x
