"""Self-check of lab 2: do your straggler runs show what the consistency models promise?

    python -m experiments.sweep experiments/labs/lab2_ps.toml
    python -m experiments.labs.check_ps results/lab2_ps

Reads the sweep's records (strategies.train --sync ps with a straggler) and
checks, per consistency model, what lab 2 asks you to predict:

  bsp   staleness is always 0, and the fast worker's step takes at least the
        straggler's delay: it waits for the slow one every step
  ssp   staleness is bounded: at most W (s + 1) updates (W workers, bound s)
  asp   the fast worker does not wait: its mean step is well under the delay
  all   the loss still goes down

It prints what it measured beside each check, so you can compare with your
own predictions.  Exit 0 if every model present passes.
"""
import statistics
import sys
from collections import defaultdict

from strategies.config import parse_straggler
from experiments.records import load


def runs(records):
    """{(mode, staleness bound): [step records]} of the straggler runs."""
    out = defaultdict(list)
    for r in records:
        c = r.get("config", {})
        if r.get("command") == "strategies.train" and r.get("kind") == "step" and \
                c.get("sync") == "ps" and c.get("straggler"):
            out[(c.get("consistency", "bsp"), c.get("staleness", 0))].append(r)
    return out


def check(mode, bound, steps):
    """[(ok, text)] for one consistency model's run."""
    slow, delay = parse_straggler(steps[0]["config"]["straggler"])
    workers = len({s["rank"] for s in steps})
    fast = [s for s in steps if s["rank"] != slow and s["step"] > 0]
    fast_step = statistics.mean(s["step_time_s"] for s in fast)
    stale = max((s["staleness"] or 0) for s in steps)
    losses = [s["loss"] for s in sorted(steps, key=lambda s: s["step"])]
    out = [(losses[-1] < losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")]
    if mode == "bsp":
        out.append((stale == 0, f"max staleness {stale} (must be 0)"))
        out.append((fast_step >= 0.8 * delay, f"fast worker's mean step {fast_step * 1e3:.1f} ms "
                                              f">= the straggler's {delay * 1e3:.0f} ms"))
    elif mode == "ssp":
        limit = workers * (bound + 1)
        out.append((stale <= limit, f"max staleness {stale} <= W (s + 1) = {limit}"))
    elif mode == "asp":
        out.append((fast_step < 0.5 * delay, f"fast worker's mean step {fast_step * 1e3:.1f} ms "
                                             f"< half the straggler's {delay * 1e3:.0f} ms"))
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    found = runs(load(argv[0]))
    if not found:
        print(f"no straggler runs of --sync ps in {argv[0]}/records.jsonl: run the lab's sweep")
        return 1
    failed = 0
    for (mode, bound), steps in sorted(found.items()):
        print(f"{mode}" + (f"(s={bound})" if mode == "ssp" else ""))
        for ok, text in check(mode, bound, steps):
            failed += not ok
            print(f"  {'ok  ' if ok else 'FAIL'} {text}")
    print("PASS" if not failed else f"FAIL: {failed} checks")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
