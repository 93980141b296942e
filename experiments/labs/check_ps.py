"""Self-check of lab 2: your predictions, then what your straggler runs show.

    .venv/bin/python -m experiments.labs.check_ps my_ps.toml          # your predictions
    .venv/bin/python -m experiments.sweep experiments/labs/lab2_ps.toml
    .venv/bin/python -m experiments.labs.check_ps results/lab2_ps     # the runs

A .toml file holds your predictions (the template is in the lab sheet), made
before you run anything, and each is graded against the formula: `ok` or
`WRONG` with your figure, never the expected one.

    [bytes_per_step]   payload bytes sent in one step by a ps worker, a ps server
                       and a ring all-reduce rank (BytePS's accounting: a worker
                       pushes n and pulls n; each of S servers sends W n / S)
    [staleness]        in updates: under BSP; and of each of the straggler's
                       updates under SSP once the run is steady

A results directory holds the sweep's records (strategies.train --sync ps
with a straggler, and one ASP run without, the "delay-free" run), and is checked
per consistency model, by ratios of one step to another, never by fixed
milliseconds (a busy or a one-core machine stretches every step alike):

  bsp   staleness is always 0, and the fast worker waits for the slow one every
        step: its step is at least 0.8 x the straggler's
  ssp   staleness stays within what the bound s allows: (W - 1)(2s + 1) updates
  asp   the fast worker does not wait: its step is within 1.5 x the delay-free step
  all   the loss still goes down

A worker's step is the median of its step_time_s (every wait inside a step
included: the server's reply, SSP's bound), the first step left out, and the
metrics' flush between steps left out for every consistency the same way (BSP
flushes every step, SSP and ASP once at the end).  Printed beside each: what
each run measured (bytes sent per step, staleness), for you to hold against
your predictions.  Exit 0 if everything present passes.
"""
import statistics
import sys
import tomllib
from collections import defaultdict

from . import grading

BYTES_PER_PARAM = 4     # fp32


def predictions(a):
    """(name, yours, right) of every prediction in the answers file."""
    psi, W, S, P = a["params"], a["workers"], a["servers"], a["ring_ranks"]
    n = BYTES_PER_PARAM * psi
    want = {"bytes_per_step": {"ps_worker": n,                  # its push (the pull comes back)
                               "ps_server": W * n / S,          # its 1/S of n to each worker
                               "ring_rank": 2 * (P - 1) / P * n},
            # staleness counts the updates a key took between a worker's read and its
            # push.  BSP applies one update a step, after every push: nothing comes
            # between.  SSP with one persistent straggler settles where the W - 1 fast
            # workers, s + 1 steps ahead, each push once per straggler step.
            "staleness": {"bsp": 0, "ssp_straggler": W - 1}}
    for table, right in want.items():
        for key, value in right.items():
            yield f"{table}.{key}", a.get(table, {}).get(key), value


def grade(path):
    with open(path, "rb") as f:
        answers = tomllib.load(f)
    wrong, _ = grading.grade(predictions(answers))
    print("PASS" if not wrong else f"FAIL: {wrong} wrong")
    return 0 if not wrong else 1


DELAY_FREE = "delay-free"      # the sweep's label of the ASP run without a straggler
BSP_PACE = 0.8                 # BSP's fast worker: at least this times the straggler's step
ASP_PACE = 1.5                 # ASP's fast worker: at most this times its delay-free step


def runs(records):
    """{(mode, staleness bound): [step records]} of the straggler runs,
    {sync: [step records]} of the runs without one, and the delay-free run's
    step records."""
    straggling, plain, free = defaultdict(list), defaultdict(list), []
    for r in records:
        c = r.get("config", {})
        if r.get("command") != "strategies.train" or r.get("kind") != "step":
            continue
        if c.get("sync") == "ps" and c.get("straggler"):
            straggling[(c.get("consistency", "bsp"), c.get("staleness", 0))].append(r)
        elif r.get("label") == DELAY_FREE:
            free.append(r)
        elif not c.get("straggler"):
            plain[c.get("sync")].append(r)
    return straggling, plain, free


def own_step(steps):
    """A worker's step in seconds: the median over these records' steps (the
    first, a warm-up, left out) of step_time_s, then the mean over the workers.
    Every wait inside a step is in it; the metrics' flush, between steps, is not,
    whichever the consistency."""
    per_rank = defaultdict(list)
    for s in steps:
        if s["step"] > 0 or len(steps) == 1:
            per_rank[s["rank"]].append(s["step_time_s"])
    return statistics.mean(statistics.median(times) for times in per_rank.values())


def check(mode, bound, steps, free):
    """[(ok, text)] for one consistency model's run; free: the delay-free step (s),
    None if the results hold no delay-free run."""
    from strategies.config.settings import parse_straggler      # imports torch: only for runs
    slow, delay = parse_straggler(steps[0]["config"]["straggler"])
    workers = len({s["rank"] for s in steps})
    fast = own_step([s for s in steps if s["rank"] != slow])
    stale = max((s["staleness"] or 0) for s in steps)
    losses = [s["loss"] for s in sorted(steps, key=lambda s: s["step"])]
    out = [(losses[-1] < losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")]
    pace = (f"fast worker: a step every {fast * 1e3:.1f} ms" +
            (f", {fast / free:.2f} x the delay-free step ({free * 1e3:.1f} ms)" if free else ""))
    if mode == "bsp":
        out.append((stale == 0, f"max staleness {stale} (must be 0)"))
        straggler = own_step([s for s in steps if s["rank"] == slow])
        out.append((fast >= BSP_PACE * straggler,
                    f"{pace}: {fast / straggler:.2f} x the straggler's step ({straggler * 1e3:.1f} "
                    f"ms; must be >= {BSP_PACE:g} x: it waits for the straggler every step)"))
    elif mode == "ssp":
        limit = (workers - 1) * (2 * bound + 1)
        out.append((stale <= limit, f"max staleness {stale} <= (W - 1)(2s + 1) = {limit} updates"))
        out.append((True, f"{pace} (measured, not graded)"))
    elif mode == "asp" and free:
        out.append((fast <= ASP_PACE * free, f"{pace} (must be <= {ASP_PACE:g} x: it does not "
                                             f"wait for the straggler)"))
    if not free and mode == "asp":
        out.append((False, f"{pace}; no delay-free run (label \"{DELAY_FREE}\") to hold it "
                           f"against: run the lab's sweep"))
    if mode != "bsp":
        mine = [s["staleness"] or 0 for s in steps if s["rank"] == slow and s["step"] > 0]
        out.append((True, f"the straggler's updates: median staleness "
                          f"{statistics.median(mine):g} updates (measured, not graded)"))
    return out


def measured_bytes(plain):
    """Lines: bytes each worker sent per step in the runs without a straggler."""
    for sync, steps in sorted(plain.items()):
        sent = statistics.median(s["bytes_sent"] for s in steps if s.get("bytes_sent"))
        yield f"{sync}: a worker sent {sent:,.0f} bytes per step (median over ranks and steps)"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv in (["-h"], ["--help"]) else 2
    if argv[0].endswith(".toml"):
        return grade(argv[0])
    from experiments.records import load
    straggling, plain, delay_free = runs(load(argv[0]))
    if not straggling:
        print(f"no straggler runs of --sync ps in {argv[0]}/records.jsonl: run the lab's sweep")
        return 1
    for line in measured_bytes(plain):
        print(line)
    failed = 0
    free = own_step(delay_free) if delay_free else None
    if free:
        print(f"delay-free (asp, no straggler): a worker's step {free * 1e3:.1f} ms")
    for (mode, bound), steps in sorted(straggling.items()):
        print(f"{mode}" + (f"(s={bound})" if mode == "ssp" else ""))
        for ok, text in check(mode, bound, steps, free):
            failed += not ok
            print(f"  {'ok  ' if ok else 'FAIL'} {text}")
    print("PASS" if not failed else f"FAIL: {failed} checks")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
