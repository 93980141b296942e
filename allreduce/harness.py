"""The benchmark harness, written once: warm-up, interleaved rounds, barrier, slowest rank, medians.

    timings = interleaved({"ring": lambda: ring.allreduce(x), "mpi": lambda: mpi.allreduce(x)},
                          rounds=20, warmup=3, comm=MPI.COMM_WORLD, before=lambda name: x.fill(1))
    timings.median("ring"), timings.spread("ring"), timings.ratio("ring", "mpi")

Why interleaved.  The machines this is run on (a shared VM, a laptop that
throttles) change speed minute by minute.  Timing all of A, then all of B, then
all of C would charge the drift to whichever ran in the slow minute; rounds of
A B C A B C ... charge it to all alike, and the ratio of two candidates within a
round cancels it (`Timings.ratio`: the median of the per-round ratios).

One sample is: `before(name)` (untimed: reset the input, as a training step
gets a fresh gradient), `settle()`, a barrier, the clock, `calls` calls back to
back, `settle()`, the clock; the sample is the time per call.  calls = 1 times a
collective whose ranks start together, as in a training step; calls = N times N
calls after one barrier, as the OSU benchmarks do, which hides the barrier's
own wake-up at small sizes.  `each_call=True` instead keeps every one of the N
calls as a sample of its own, `before` run untimed ahead of each
(experiments/calibrate.py: a probe that must start from the same caches every time).
`after(name)`, untimed, follows every sample: a closing barrier and a reading of
the servers' CPU time (psrv/bench.py).  `own_clock=True` is for a sample this
clock cannot see: each call returns its own seconds, one number or a list (a whole
training launch that records its steps' times, strategies/bench_parallel.py).

The slowest rank.  A collective is as slow as its slowest rank, so with `comm`
(an mpi4py communicator) every sample becomes the maximum over ranks of that
sample, taken once at the end (one Allreduce, nothing between the timed calls).
Processes that are not one MPI job (psrv's workers) time themselves with a
`barrier` of their own and hand their Timings to one process, which takes
`slowest(timings_of_each_process)`.

The medians are the figures; `spread` (the quartiles) gives error bars.  Where
a figure is a mean that a step pays in full (a wait that takes two values, one
time slice or none), `interquartile_mean` of per-round means is the robust
figure: a round the machine gave to someone else falls in the cut quarters,
while the middle half still averages both values where a median would pick one.
"""
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Timings:
    """Seconds per call of each candidate, sample by sample: samples[name][round]."""
    samples: dict = field(default_factory=dict)

    @property
    def names(self):
        return list(self.samples)

    def median(self, name):
        return float(np.median(self.samples[name]))

    def medians(self):
        return {name: self.median(name) for name in self.samples}

    def spread(self, name, low=25, high=75):
        """(low, high) percentiles of the samples: the error bar of the median."""
        lo, hi = np.percentile(self.samples[name], [low, high])
        return float(lo), float(hi)

    def ratio(self, name, baseline):
        """The median over rounds of name's time / baseline's time in the same round:
        the drift of the machine between rounds cancels."""
        a, b = np.asarray(self.samples[name]), np.asarray(self.samples[baseline])
        if len(a) != len(b):
            raise ValueError(f"{name} has {len(a)} samples and {baseline} {len(b)}: a ratio "
                             f"pairs samples of the same round")
        return float(np.median(a / b))


def interquartile_mean(values):
    """The mean of the middle half of `values` (a quarter cut from each end, rounded
    down; all of them below 4): robust to a few outliers either way, still a mean."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("interquartile_mean: no values")
    cut = len(ordered) // 4
    middle = ordered[cut:len(ordered) - cut]
    return float(sum(middle) / len(middle))


def slowest(timings):
    """One Timings from several processes' (same candidates, same number of samples):
    each sample the largest of theirs.  What `comm` does inside an MPI job."""
    timings = list(timings)
    first = timings[0]
    for t in timings[1:]:
        if t.names != first.names or any(len(t.samples[n]) != len(first.samples[n])
                                         for n in first.names):
            raise ValueError("slowest: every process must time the same candidates as often")
    return Timings({name: np.max([t.samples[name] for t in timings], axis=0).tolist()
                    for name in first.names})


def time_sample(call, calls=1, barrier=None, settle=None):
    """Seconds per call of `calls` calls of `call()` after one barrier."""
    if settle:
        settle()
    if barrier:
        barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    if settle:
        settle()
    return (time.perf_counter() - start) / calls


def interleaved(candidates, rounds, warmup=1, calls=1, comm=None, barrier=None, before=None,
                settle=None, each_call=False, prime=0, after=None, own_clock=False):
    """Time named candidates in interleaved rounds; returns Timings (the slowest rank's).

    candidates  {name: call}: a call takes no arguments; one call is what is timed.
                `calls` may instead be {name: N}, a number of calls per candidate.
    rounds      samples per candidate, taken A B C A B C ...
    warmup      rounds run first, untimed, interleaved as well (connections, caches)
    comm        an mpi4py communicator: its Barrier before every sample, and the
                slowest rank's samples in the result (every rank gets them)
    barrier     a barrier of its own (multiprocessing.Barrier(...).wait) for processes
                outside one MPI job; with neither, the samples of this process alone
    before      before(name), untimed, ahead of every sample (every call, each_call)
    settle      waits for queued device work (torch.cuda.synchronize) around the clock
    each_call   keep each of the calls as a sample (one barrier ahead of them all)
    prime       untimed calls of a candidate right before each of its samples: its
                caches as a repeated call leaves them, whatever ran before it
    after       after(name), untimed, behind every sample
    own_clock   a call returns its own sample(s) in seconds: a number or a list
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"interleaved: rounds must be >= 1 and warmup >= 0, "
                         f"got rounds={rounds} warmup={warmup}")
    if comm is not None and barrier is None:
        barrier = comm.Barrier
    per_name = calls if isinstance(calls, dict) else {name: calls for name in candidates}
    if any(per_name.get(name, 0) < 1 for name in candidates):
        raise ValueError(f"interleaved: every candidate needs calls >= 1, got {per_name}")
    samples = {name: [] for name in candidates}
    for rnd in range(warmup + rounds):
        for name, call in candidates.items():           # interleaved: A B C A B C ...
            for _ in range(prime):
                call()
            if each_call:
                seconds = each_call_samples(name, call, per_name[name], barrier, before, settle)
            else:
                if before:
                    before(name)
                seconds = own_clock_samples(call, barrier) if own_clock else \
                    [time_sample(call, per_name[name], barrier, settle)]
            if after:
                after(name)
            if rnd >= warmup:
                samples[name].extend(seconds)
    timings = Timings(samples)
    return slowest_rank(timings, comm) if comm is not None and comm.size > 1 else timings


def each_call_samples(name, call, calls, barrier, before, settle):
    """`calls` samples of one call each, after one barrier; before(name) untimed ahead of each."""
    if barrier:
        barrier()
    seconds = []
    for _ in range(calls):
        if before:
            before(name)
        seconds.append(time_sample(call, 1, None, settle))
    return seconds


def own_clock_samples(call, barrier):
    """The seconds one call says it took, after one barrier: always a list."""
    if barrier:
        barrier()
    seconds = call()
    return [float(seconds)] if np.isscalar(seconds) else [float(s) for s in seconds]


def slowest_rank(timings, comm):
    """Every sample the maximum over the ranks of `comm` (one Allreduce for all)."""
    from mpi4py import MPI
    names = timings.names
    lengths = [len(timings.samples[n]) for n in names]
    mine = np.concatenate([np.asarray(timings.samples[n], float) for n in names]) \
        if names else np.zeros(0)
    worst = np.empty_like(mine)
    comm.Allreduce(mine, worst, op=MPI.MAX)
    bounds = np.cumsum([0] + lengths)
    return Timings({n: worst[a:b].tolist() for n, a, b in zip(names, bounds, bounds[1:])})
