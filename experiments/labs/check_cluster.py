"""Self-check of lab 6: the bytes an all-reduce puts on a host's link, and the time the link takes.

    python -m experiments.labs.check_cluster my_cluster.toml

Answer file (the template is in the lab sheet):

    bytes = 16777216      # n: one all-reduce of 16 MiB
    gbps = 1              # each host's link, Gbit/s each way
    [2x2]                 # 2 hosts x 2 ranks, ranks in blocks (host 0: ranks 0, 1)
    ring = 0              # bytes the busiest host sends across its link, one all-reduce
    tree = 0
    halving_doubling = 0
    hierarchical = 0
    [2x2.link_ms]         # ms of one all-reduce if only the link took time (no latency)
    ring = 0
    ...
    [4x1]                 # as many layouts as you like: NxR
    ...

An answer within 1 % passes.  A wrong one is named but not corrected: the
expected figure is printed only beside answers that are right, so the check
can be run again after thinking, not copied.  The reference is the project's
own accounting (allreduce.theory.host_link_bytes, allreduce/twolevel.py).
"""
import argparse
import re
import sys
import tomllib

from allreduce.costs import Machine
from allreduce.theory import host_link_bytes
from allreduce.twolevel import ALGOS, cluster_allreduce_time, link_of_rate

from .grading import grade

LAYOUT = re.compile(r"(\d+)x(\d+)")
FREE = Machine(0.0, 0.0, 0.0)            # only the link takes time


def expected(algo, n, nodes, R, gbps):
    """(bytes on the busiest host's link, ms if only the link took time)."""
    busiest = max(host_link_bytes(algo, n, nodes, R))
    seconds = cluster_allreduce_time(algo, n, nodes, R, FREE, link_of_rate(gbps))
    return busiest, seconds * 1e3


def checks(answers):
    """(name, yours, expected) of every answer in the file; raises ValueError on a
    file that names no layout, an unknown layout or an unknown algorithm."""
    n, gbps = answers.get("bytes"), answers.get("gbps")
    if not isinstance(n, int) or n <= 0 or not isinstance(gbps, (int, float)) or gbps <= 0:
        raise ValueError("the file needs bytes = N (> 0, an integer) and gbps = G (> 0)")
    layouts = {k: v for k, v in answers.items() if k not in ("bytes", "gbps")}
    if not layouts:
        raise ValueError("no layout: add a table such as [2x2] (2 hosts x 2 ranks)")
    out = []
    for name, table in layouts.items():
        match = LAYOUT.fullmatch(name)
        if not match or not isinstance(table, dict) or min(map(int, match.groups())) < 1:
            raise ValueError(f"[{name}] is not a layout: write [NxR], N hosts x R ranks")
        nodes, R = map(int, match.groups())
        times = table.get("link_ms", {})
        for key in [k for k in table if k != "link_ms"] + list(times):
            if key not in ALGOS:
                raise ValueError(f"[{name}] {key}: not one of {', '.join(ALGOS)}")
        for algo in ALGOS:
            busiest, ms = expected(algo, n, nodes, R, gbps)
            if algo in table:
                out.append((f"{name} {algo} bytes", table[algo], busiest))
            if algo in times:
                out.append((f"{name} {algo} link_ms", times[algo], ms))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.labs.check_cluster",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="your answers (TOML)")
    a = ap.parse_args(argv)
    try:
        with open(a.file, "rb") as f:
            found = checks(tomllib.load(f))
    except (OSError, tomllib.TOMLDecodeError, ValueError) as e:
        print(f"check_cluster: {a.file}: {e}")
        return 2
    if not found:
        print("no answers found: fill in the template of the lab sheet")
        return 1
    wrong, total = grade(found)
    print("PASS" if not wrong else f"FAIL: {wrong} of {total} wrong")
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
