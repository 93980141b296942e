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
with a straggler), and is checked per consistency model:

  bsp   staleness is always 0, and the fast worker takes a step every straggler's
        delay or more of wall-clock: it waits for the slow one every step
  ssp   staleness stays within what the bound s allows: (W - 1)(2s + 1) updates
  asp   the fast worker does not wait: its wall-clock step is well under the delay
(wall-clock: from the end of its first step to the end of its last, every wait
included, over the steps between)
  all   the loss still goes down

beside what each run measured (bytes sent per step, staleness), for you to
hold against your predictions.  Exit 0 if everything present passes.
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


def runs(records):
    """{(mode, staleness bound): [step records]} of the straggler runs, and
    {sync: [step records]} of the runs without one."""
    straggling, plain = defaultdict(list), defaultdict(list)
    for r in records:
        c = r.get("config", {})
        if r.get("command") != "strategies.train" or r.get("kind") != "step":
            continue
        if c.get("sync") == "ps" and c.get("straggler"):
            straggling[(c.get("consistency", "bsp"), c.get("staleness", 0))].append(r)
        elif not c.get("straggler"):
            plain[c.get("sync")].append(r)
    return straggling, plain


def wall_clock_step(steps):
    """Seconds of wall-clock a step of these records' workers take, waits included, the
    mean over the workers: from the end of a worker's first step to the end of its last
    (ended_s), over the steps between.  Records without ended_s: the mean of their step
    times (which leave out the waits between steps)."""
    per_rank = defaultdict(list)
    for s in steps:
        per_rank[s["rank"]].append(s)
    rates = []
    for mine in per_rank.values():
        mine.sort(key=lambda s: s["step"])
        if all("ended_s" in s for s in mine) and len(mine) > 1:
            rates.append((mine[-1]["ended_s"] - mine[0]["ended_s"]) /
                         (mine[-1]["step"] - mine[0]["step"]))
        else:
            rates.append(statistics.mean(s["step_time_s"] for s in mine[1:] or mine))
    return statistics.mean(rates)


def check(mode, bound, steps):
    """[(ok, text)] for one consistency model's run."""
    from strategies.config.settings import parse_straggler      # imports torch: only for runs
    slow, delay = parse_straggler(steps[0]["config"]["straggler"])
    workers = len({s["rank"] for s in steps})
    fast_step = wall_clock_step(s for s in steps if s["rank"] != slow)
    stale = max((s["staleness"] or 0) for s in steps)
    losses = [s["loss"] for s in sorted(steps, key=lambda s: s["step"])]
    out = [(losses[-1] < losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")]
    if mode == "bsp":
        out.append((stale == 0, f"max staleness {stale} (must be 0)"))
        out.append((fast_step >= 0.8 * delay, f"fast worker: a step every {fast_step * 1e3:.1f} ms "
                                              f"of wall-clock, >= the straggler's delay "
                                              f"{delay * 1e3:.0f} ms"))
    elif mode == "ssp":
        limit = (workers - 1) * (2 * bound + 1)
        out.append((stale <= limit, f"max staleness {stale} <= (W - 1)(2s + 1) = {limit} updates"))
    elif mode == "asp":
        out.append((fast_step < 0.5 * delay, f"fast worker: a step every {fast_step * 1e3:.1f} ms "
                                             f"of wall-clock, < half the straggler's delay "
                                             f"{delay * 1e3:.0f} ms"))
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
    straggling, plain = runs(load(argv[0]))
    if not straggling:
        print(f"no straggler runs of --sync ps in {argv[0]}/records.jsonl: run the lab's sweep")
        return 1
    for line in measured_bytes(plain):
        print(line)
    failed = 0
    for (mode, bound), steps in sorted(straggling.items()):
        print(f"{mode}" + (f"(s={bound})" if mode == "ssp" else ""))
        for ok, text in check(mode, bound, steps):
            failed += not ok
            print(f"  {'ok  ' if ok else 'FAIL'} {text}")
    print("PASS" if not failed else f"FAIL: {failed} checks")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
