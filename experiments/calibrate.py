"""Fit the cost model's alpha, beta, gamma on this machine with a short microbenchmark.

    python -m experiments.calibrate --out results       # ~45 s: results/calibration.json
    python -m experiments.calibrate --no-ps --jsonl results/x/records.jsonl
    sudo .venv/bin/python -m experiments.cluster run --nodes 2 --ranks-per-node 2 \\
        --inter-gbps 1 -- experiments.calibrate --reps 5 --out results/cluster-cal  # + link

Started by mpiexec on several hosts (emulated, as above, or real) it calibrates a host
and the link between (experiments/calibrate_link.py).  What follows is the one-host part.

Measurements, all but one of them point-to-point, so that predicting the
collectives' large messages from them is a real test of the model (costmodel.py):

  alpha         The latency of one step of our algorithms, their Python
                included: an all-reduce of 2 floats by the ring (2 steps at P =
                2), halved.  A bare exchange (alpha_exchange_s, below) takes
                about 10 us here; a step adds 10-15 us of bookkeeping around it
                (posting, polling, dispatching the add), LogP's overhead o,
                which is about 10 % of a 1 MiB ring and so cannot be left out.
  beta          Two ranks under mpiexec exchange b bytes at once in both
                directions (sendrecv through allreduce's MPI transport), which
                is what every step of a ring does; t(b) = alpha_exchange + b *
                beta, alpha_exchange fitted below 1 MiB, beta at 1 MiB and above
                (fit_two_regimes); and beta per size, (t(b) - alpha_exchange) / b
                at b >= 1 MiB: the curve costmodel's beta_at(b) reads.
                t(b) is the mean of the two kinds of step a ring takes, in
                equal numbers (CACHES below): a reduce-scatter step receives
                into a scratch buffer nobody reads; an all-gather step receives
                into the chunk the neighbour read one step before.  Both send
                a chunk just written.
  beta1         The same two kinds of step, sent one way (the two ranks take
                turns sending): what a tree's rounds, a fold, a gather and a
                broadcast do; the curve costmodel's beta_one_way_at(b) reads.
  gamma         np.add(a, b, out=a) per byte of the vector reduced (the
                reduction of allreduce.buffers.reduce_into), with both ranks
                busy at once, as in a ring; per size (1, 4, 16 MiB), since a
                vector that fits in the caches adds about twice as fast.  `a`
                is private, as a rank's own chunk is when its input is fresh
                (allreduce.bench writes it before every call, backward before
                every step).
  memcpy        np.copyto bandwidth: the roofline of plot (a).
  ps_*          psrv's push+pull with W = 1, 2, 3 workers (calibrate_ps.py).

CACHES.  Writing a cache line that the other core holds means invalidating its
copy first, and on this VM that costs far more when its two vCPUs sit apart (a
mode that comes and goes every minute or two).  There,
with 512 KiB chunks: an exchange into a buffer nobody reads took 125 us, into
one the peer had just read 190 us (and np.copyto into such a buffer 110 us
against 22 us).  MPICH's single-copy path (CMA) writes straight into the
receive buffer, so it pays this in full.  A ring pays it on its all-gather
steps: each receives into a chunk the neighbour read during the reduce-scatter.
(Called again on the same buffer, it would pay it on its adds too; a benchmark
or a training step gives it a fresh input.)  Probes that touch only private
buffers predicted the ring 1.6-2x too fast in that mode.

--verify ring,tree,... also times those all-reduces (1, 4, 16 MiB) in the same
rounds as the probes, and keeps psrv's W = 3 as a prediction to check: the
fairest test of the model on a machine whose speed drifts minute to minute,
since prediction and measurement come from the same minutes.  Their median in
each round (round_us) shows that drift: how far any prediction made minutes
before a measurement can be trusted on this machine.

The driver (no mpiexec) launches the MPI part under mpiexec -n 2, runs the
psrv part itself, and writes DIR/calibration.json (--out DIR; every reader of a
calibration takes the file or DIR) and, with --jsonl, one record of kind
"calibration" for the report.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from allreduce.cli import add_output_flags
from allreduce.records import (CALIBRATION, append_jsonl, mpiexec_path, provenance,
                               write_calibration)

from . import calibrate_link
from .calibrate_link import GAMMA_SIZES    # one figure for both levels
from .calibrate_ps import ps_part
from .fits import LARGE, fit_two_regimes

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20]
VERIFY_SIZES = [1 << 20, 4 << 20, 16 << 20]


def mpi_part(reps, verify=(), comm=None):
    """Under mpiexec -n 2 (or on a 2-rank `comm`): exchange times per size, gamma and
    memcpy, and (verify) the named all-reduces timed in the same rounds; rank 0 returns them."""
    import allreduce
    from mpi4py import MPI

    from allreduce.harness import interleaved
    from allreduce.transport import MPITransport
    comm = comm or MPI.COMM_WORLD
    t = MPITransport(comm)
    if t.size != 2:
        raise SystemExit(f"the MPI part runs on exactly 2 ranks, not {t.size}")
    peer = 1 - t.rank
    # Per size: a chunk to send and a scratch buffer to receive into (a
    # reduce-scatter step), and two buffers swapped after every exchange, so
    # that each call receives into what the peer has just read (an all-gather step).
    steps = {n: (np.ones(n // 4, np.float32), np.empty(n // 4, np.float32),
                 [np.ones(n // 4, np.float32), np.ones(n // 4, np.float32)]) for n in SIZES}
    a, b = np.ones(16 << 18, np.float32), np.ones(16 << 18, np.float32)     # 16 MiB each
    adds = {n: (a[:n // 4], b[:n // 4]) for n in GAMMA_SIZES}
    ring, tiny = allreduce.create("ring", comm=comm), np.zeros(2, np.float32)
    colls = {name: allreduce.create(name, comm=comm) for name in verify}
    for c in (ring, *colls.values()):
        c.check = False
    work = {n: np.zeros(n // 4, np.float32) for n in VERIFY_SIZES}   # sums stay finite
    one_way_calls = 0   # the one-way probes alternate the sender call by call

    def allgather_step(pair):
        send, recv = pair
        t.sendrecv(send, peer, recv, peer)
        pair.reverse()

    def one_way(send, recv):
        """Rank 0 sends, then rank 1, then rank 0...: both directions count alike."""
        nonlocal one_way_calls
        if t.rank == one_way_calls % 2:
            t.send(send, peer)
        else:
            t.recv(recv, peer)
        one_way_calls += 1

    # Every probe and every verified all-reduce once per round (allreduce.harness), so
    # a machine that changes speed mid-run slows all alike; before(), untimed, sets the
    # caches up as a ring would leave them.
    probes, before, nbytes = {}, {}, {}

    def probe(key, fn, n, reset=None):
        probes[key], nbytes[key] = fn, n
        if reset:
            before[key] = reset

    for n, (send, scratch, pair) in steps.items():
        probe(("rs", n), lambda send=send, scratch=scratch: t.sendrecv(send, peer, scratch, peer),
              n, reset=lambda send=send: send.fill(1.0))
        probe(("ag", n), lambda pair=pair: allgather_step(pair), n)
        if n >= LARGE:
            probe(("rs1", n), lambda send=send, scratch=scratch: one_way(send, scratch), n,
                  reset=lambda send=send: send.fill(1.0))
            # what it sent last it now receives into: a chunk the peer just read
            probe(("ag1", n), lambda pair=pair: one_way(pair[0], pair[0]), n)
    for n, (x, y) in adds.items():
        probe(("add", n), lambda x=x, y=y: np.add(x, y, out=x), n)
    probe("copy", lambda: np.copyto(a, b), a.nbytes)
    probe("step", lambda: ring.allreduce(tiny), 8)
    for name, c in colls.items():
        for n in VERIFY_SIZES:        # a fresh input each call, as in allreduce.bench
            probe((name, n), lambda c=c, n=n: c.allreduce(work[n]), n,
                  reset=lambda n=n: work[n].fill(0.0))
    # k calls a probe a round (k ~ 8 MiB / nbytes, 3 to 50), each its own sample, so
    # that a call the hypervisor stalled for a millisecond, which this VM does every
    # few dozen calls, moves the median no more than any other; one untimed call
    # first, so the caches are as warm as in a benchmark that repeats one call.
    calls = {key: min(50, max(3, (8 << 20) // max(n, 1))) for key, n in nbytes.items()}
    timings = interleaved(probes, rounds=reps, warmup=1, calls=calls, comm=comm,
                          barrier=t.barrier, each_call=True, prime=1,
                          before=lambda key: before[key]() if key in before else None)
    med = timings.medians()                            # the slowest rank's samples
    # the verified all-reduces' median in each round: the machine's drift
    per_round = {key: np.median(np.reshape(timings.samples[key], (reps, calls[key])), axis=1)
                 for key in timings.names if key[0] in colls}
    exchange = [(med[("rs", n)] + med[("ag", n)]) / 2 for n in SIZES]
    alpha, beta = fit_two_regimes(SIZES, exchange)
    large = [n for n in SIZES if n >= LARGE]
    return {"alpha_s": med["step"] / 2, "alpha_exchange_s": alpha, "beta_s_per_byte": beta,
            "gamma_s_per_byte": med[("add", a.nbytes)] / a.nbytes,
            "beta_bytes": large, "beta_s_per_byte_at": [(sec - alpha) / n for n, sec in
                                                        zip(SIZES, exchange) if n >= LARGE],
            "beta_one_way_bytes": large,
            "beta_one_way_s_per_byte_at": [((med[("rs1", n)] + med[("ag1", n)]) / 2 - alpha) / n
                                           for n in large],
            "one_way_scratch_s": [med[("rs1", n)] for n in large],
            "one_way_just_read_s": [med[("ag1", n)] for n in large],
            "gamma_bytes": GAMMA_SIZES, "gamma_s_per_byte_at": [med[("add", n)] / n
                                                                for n in GAMMA_SIZES],
            "memcpy_gbps": a.nbytes / med["copy"] / 1e9, "exchange_bytes": SIZES,
            "exchange_s": exchange, "world_size": 2,
            "exchange_scratch_s": [med[("rs", n)] for n in SIZES],
            "exchange_just_read_s": [med[("ag", n)] for n in SIZES],
            "verify": [{"algo": name, "bytes": n, "world_size": 2, "time_us": med[(name, n)] * 1e6,
                        "round_us": [round(float(x) * 1e6, 1) for x in per_round[(name, n)]]}
                       for name in colls for n in VERIFY_SIZES]}


def parser():
    p = argparse.ArgumentParser(prog="python -m experiments.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_flags(p, out_what=f"{CALIBRATION} (the fitted constants)")
    p.add_argument("--reps", type=int, default=15, help="timed rounds of every probe")
    p.add_argument("--no-ps", dest="ps", action="store_false", help="skip the psrv part")
    p.add_argument("--verify", default="ring,tree,halving_doubling",
                   help="all-reduces timed in the same rounds as the probes ('' for none)")
    p.add_argument("--mpi-part", default="", metavar="FILE",
                   help="(internal) run the MPI part under mpiexec -n 2, write it to FILE")
    return p


def main(argv=None):
    """Calibrate (one host, or every host mpiexec started it on); exit status 0."""
    a = parser().parse_args(argv)
    if a.out.endswith(".json"):
        parser().error(f"--out {a.out!r}: --out names a directory, into which {CALIBRATION} "
                       f"is written (e.g. --out results)")
    verify = [v for v in a.verify.split(",") if v]
    if a.mpi_part:
        result = mpi_part(a.reps, verify)
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 0:
            with open(a.mpi_part, "w") as f:
                json.dump(result, f)
        return 0
    if calibrate_link.launched_on_hosts():
        result = calibrate_link.calibrate_hosts(a.reps, verify, mpi_part)
        if result is None:                  # not rank 0, which prints and writes
            return 0
        print(calibrate_link.describe(result), flush=True)
        # Its own kind: the report's one-host predictions read "calibration" records.
        kind = "link_calibration"
    else:
        kind = "calibration"
        with tempfile.TemporaryDirectory() as tmp:
            part = os.path.join(tmp, "mpi.json")
            subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "mpi4py", "-m",
                            "experiments.calibrate", "--mpi-part", part, "--reps", str(a.reps),
                            "--verify", a.verify], check=True, timeout=300)
            with open(part) as f:
                result = json.load(f)
        if a.ps:
            result.update(ps_part(max(5, a.reps // 2), bool(a.verify)))
        result["cores"] = os.cpu_count()
        result["loadavg"] = os.getloadavg()
        print(f"alpha {result['alpha_s'] * 1e6:.1f} us  beta "
              f"{1e-9 / result['beta_s_per_byte']:.2f} GB/s  gamma "
              f"{1e-9 / result['gamma_s_per_byte']:.2f} GB/s  memcpy "
              f"{result['memcpy_gbps']:.1f} GB/s" + (
                  f"  ps_alpha {result['ps_alpha_s'] * 1e6:.0f} us  ps_beta "
                  f"{1e-9 / result['ps_beta_s_per_byte']:.2f} GB/s" if a.ps else ""), flush=True)
    if a.out:
        print(f"wrote {write_calibration(a.out, result)}", flush=True)
    if a.jsonl:
        append_jsonl(a.jsonl, [{"kind": kind, **result, "provenance": provenance()}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
