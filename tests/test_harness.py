"""Tier (a) and (c): the one benchmark harness (allreduce/harness.py).

A fake clock makes every duration known, so the tests check exactly what the
harness reports (order of calls, seconds per call, the slowest rank) without
timing anything real.
"""

import pytest

from allreduce import harness
from allreduce.harness import Timings, interleaved, slowest

from conftest import check_ok, mpirun


class FakeClock:
    """perf_counter that moves only when a candidate says how long it took."""
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def spend(self, seconds):
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(harness.time, "perf_counter", fake)
    return fake


def test_rounds_interleave_after_warmup_with_a_barrier_and_reset_before_each(clock):
    log = []
    candidates = {name: (lambda name=name: log.append(("call", name))) for name in "ABC"}
    timings = interleaved(candidates, rounds=2, warmup=1, before=lambda n: log.append(("before", n)),
                          barrier=lambda: log.append(("barrier",)))
    one_round = [e for n in "ABC" for e in (("before", n), ("barrier",), ("call", n))]
    assert log == one_round * 3                           # 1 warm-up round + 2 rounds
    assert timings.names == ["A", "B", "C"] and all(len(s) == 2 for s in timings.samples.values())


def test_a_sample_is_seconds_per_call(clock):
    spent = {"fast": 1.0, "slow": 3.0}
    calls = {"fast": 0, "slow": 0}

    def make(name):
        def call():
            calls[name] += 1
            clock.spend(spent[name])
        return call
    timings = interleaved({n: make(n) for n in spent}, rounds=3, warmup=2, calls=4)
    assert calls == {"fast": 4 * 5, "slow": 4 * 5}
    assert timings.samples == {"fast": [1.0] * 3, "slow": [3.0] * 3}
    assert timings.medians() == {"fast": 1.0, "slow": 3.0} and timings.ratio("slow", "fast") == 3


def test_each_call_keeps_every_call_with_its_reset(clock):
    log, step = [], iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    timings = interleaved({"p": lambda: clock.spend(next(step))}, rounds=2, warmup=0, calls=3,
                          each_call=True, before=log.append, barrier=lambda: log.append("|"))
    assert timings.samples["p"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert log == ["|", "p", "p", "p"] * 2                # one barrier a block, a reset a call


def test_prime_calls_come_before_the_barrier_and_are_not_timed(clock):
    log = []
    timings = interleaved({"a": lambda: (log.append("call"), clock.spend(2.0))}, rounds=2,
                          warmup=0, prime=1, barrier=lambda: log.append("|"))
    assert log == ["call", "|", "call"] * 2 and timings.samples["a"] == [2.0, 2.0]


def test_after_follows_every_sample_untimed(clock):
    log = []
    timings = interleaved({"a": lambda: (log.append("call"), clock.spend(1.0))}, rounds=2,
                          warmup=1, barrier=lambda: log.append("|"),
                          after=lambda n: (log.append("after " + n), clock.spend(5.0)))
    assert log == ["|", "call", "after a"] * 3 and timings.samples["a"] == [1.0, 1.0]


def test_own_clock_samples_are_what_the_calls_return(clock):
    told = iter([9.0, [1.0, 2.0], 3.0, [4.0, 5.0], 6.0])
    timings = interleaved({"run": lambda: (clock.spend(100.0), next(told))[1]}, rounds=2,
                          warmup=1, own_clock=True)
    assert timings.samples == {"run": [1.0, 2.0, 3.0]}   # warm-up's 9 dropped; lists extend


def test_calls_per_candidate(clock):
    counts = {"big": 0, "small": 0}
    interleaved({n: (lambda n=n: counts.__setitem__(n, counts[n] + 1)) for n in counts},
                rounds=1, warmup=0, calls={"big": 2, "small": 7})
    assert counts == {"big": 2, "small": 7}


def test_statistics_of_hand_made_samples():
    t = Timings({"a": [1.0, 2.0, 3.0, 4.0, 100.0], "b": [1.0, 1.0, 1.0, 2.0, 50.0]})
    assert t.median("a") == 3.0 and t.spread("a") == (2.0, 4.0)
    # per round a/b = 1, 2, 3, 2, 2: the drift of round 5 cancels
    assert t.ratio("a", "b") == 2.0
    with pytest.raises(ValueError, match="same round"):
        Timings({"a": [1.0], "b": [1.0, 2.0]}).ratio("a", "b")


def test_interquartile_mean_cuts_a_quarter_from_each_end():
    """A mean, not a median (two modes average), but an outlier round falls in a cut quarter."""
    assert harness.interquartile_mean([1.0, 3.0] * 4) == 2.0          # both modes count
    assert harness.interquartile_mean([2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 50.0]) == 2.0
    assert harness.interquartile_mean([5.0, 1.0, 3.0]) == 3.0         # below 4: all of them
    with pytest.raises(ValueError, match="no values"):
        harness.interquartile_mean([])


def test_slowest_of_processes_is_samplewise():
    one = Timings({"a": [1.0, 5.0], "b": [2.0, 2.0]})
    two = Timings({"a": [3.0, 1.0], "b": [1.0, 4.0]})
    assert slowest([one, two]).samples == {"a": [3.0, 5.0], "b": [2.0, 4.0]}
    with pytest.raises(ValueError, match="same candidates"):
        slowest([one, Timings({"a": [1.0]})])


@pytest.mark.parametrize("bad", [dict(rounds=0), dict(rounds=1, warmup=-1),
                                 dict(rounds=1, calls=0)])
def test_bad_arguments_are_named(bad):
    with pytest.raises(ValueError, match="interleaved"):
        interleaved({"a": lambda: None}, **bad)


SCRIPT = """
from mpi4py import MPI
from allreduce import harness
clock = [0.0]
harness.time.perf_counter = lambda: clock[0]
comm = MPI.COMM_WORLD
def call(k):
    def spend():
        clock[0] += (comm.rank + 1) * k * (1 + len(samples))     # rank- and round-dependent
    return spend
samples = []
t = harness.interleaved({"a": call(1.0), "b": call(10.0)}, rounds=3, warmup=1, comm=comm,
                        before=lambda name: samples.append(name) if name == "b" else None)
P = comm.size
want = {"a": [P * 1.0 * (1 + r) for r in (1, 2, 3)], "b": [P * 10.0 * (3 + r) for r in (0, 1, 2)]}
assert t.samples == want, (comm.rank, t.samples, want)
print("ok", comm.rank)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_every_rank_gets_the_slowest_ranks_samples(tmp_path, nprocs):
    script = tmp_path / "slowest.py"
    script.write_text(SCRIPT)
    result = check_ok(mpirun(nprocs, [script], timeout=60))
    assert result.stdout.count("ok") == nprocs
