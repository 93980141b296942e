"""Calibrate both levels of a cluster in one job: shared memory inside a host, the link between.

    sudo .venv/bin/python -m experiments.cluster run --nodes 2 --ranks-per-node 2 \\
        --inter-gbps 1 -- experiments.calibrate --reps 5 --out results/cluster-cal
    mpiexec -f hostfile -n 4 -ppn 2 .venv/bin/python -m mpi4py -m experiments.calibrate \\
        --out results/hosts-cal                                          # real hosts

experiments.calibrate comes here when mpiexec started it on two hosts or more
(MPI's shared-memory split tells the hosts apart).  allreduce/twolevel.py
reads the calibration.json it writes; `allreduce.bench --predict DIR` too.

  inside a host  the first two ranks of host 0 run calibrate.mpi_part's probes
                 (alpha, beta one way and exchanged, gamma, per size) while every
                 other rank waits in MPI, polling as it would in a collective: on
                 the emulated cluster all hosts share this machine's cores, and
                 the figures are taken with the job's ranks all there.  With one
                 rank a host nothing is sent inside a host; only gamma is measured.
  the link       a = host 0's first rank, b = host 1's (a2, b2 their second):
     ping_pong   a -> b -> a, 4 KiB, 10 round trips back to back: alpha is half a
                 round trip (Hockney's latency)
     one way     a -> b, then b -> a, ...: b bytes through one direction of a link
     exchange    a <-> b at once: b each way.  A full-duplex link does not halve
                 the two directions, but TCP works at both ends of each, so an
                 exchange costs a little more per byte than one way
     shared      a <-> b and a2 <-> b2 at once (R >= 2): 2b each way through one
                 link, as when the ranks of a host cross in the same step
                 (halving-doubling's first step): about twice an exchange's time
     At 1 MiB and above, per size: inter_beta_s_per_byte_at = (t - alpha) / b
     (exchanges) and inter_beta_one_way_s_per_byte_at (one way), the curves
     allreduce/twolevel.py reads; per kind, one beta per byte through the link
     (inter_beta_<kind>_s_per_byte, alpha fixed): shared close to exchange says
     that the bytes of a host's ranks on one link add up.
  inter_gbps     the rate the link is shaped to, read from tc on the host's
                 interface (FI_TCP_IFACE, which the cluster's launcher sets); None
                 where it cannot be read (a real NIC: its speed is not a shaping).
"""
import json
import os
import subprocess
import time

import numpy as np

from allreduce.harness import interleaved
from allreduce.records import provenance

from .fits import LARGE, fit_beta

LINK_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20]
# Shared with calibrate.py, which imports this module (and not the other way round):
GAMMA_SIZES = [1 << 20, 4 << 20, 16 << 20]    # np.add per byte is measured at these
KINDS = ("one_way", "exchange", "shared")
PING_PONGS = 10             # round trips a latency probe makes back to back


def launched_on_hosts():
    """Whether mpiexec started this process with others (hydra's PMI_SIZE, Open MPI's)."""
    size = os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or "1"
    return int(size) > 1


def shaped_gbps():
    """The tbf (or netem) rate on this host's interface, Gbit/s; None if there is none."""
    iface = os.environ.get("FI_TCP_IFACE")
    if not iface:
        return None
    try:
        out = subprocess.run(["tc", "-j", "qdisc", "show", "dev", iface], capture_output=True,
                             text=True, timeout=10)
        for qdisc in json.loads(out.stdout or "[]"):
            rate = qdisc.get("options", {}).get("rate")
            if rate:
                return rate * 8 / 1e9            # tc -j gives bytes per second
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    return None


def link_part(t, a, b, a2, b2, reps):
    """Medians of the link probes, {(kind, bytes): seconds per message}, the slowest
    rank's.  Every probe starts at a barrier; ranks not in it wait there.  Kinds and
    sizes take turns, round after round (allreduce/harness.py's rounds, the first
    one a warm-up: connections), so a machine that changes speed hits all alike."""
    me = t.rank
    bufs = {n: (np.ones(n // 4, np.float32), np.empty(n // 4, np.float32)) for n in LINK_SIZES}
    kinds = KINDS if a2 is not None else KINDS[:2]
    calls = 0

    def one_way(pairs, send, recv):
        """Each (sender, receiver) of pairs at once, directions alternating call by call."""
        handles = []
        for src, dst in pairs:
            src, dst = (src, dst) if calls % 2 == 0 else (dst, src)
            if me == src:
                handles.append(t.isend(send, dst))
            elif me == dst:
                handles.append(t.irecv(recv, src))
        t.wait_all(handles)

    def probe(kind, n):
        """One probe (a ping_pong covers 2 PING_PONGS messages one after another)."""
        nonlocal calls
        send, recv = bufs[n]
        if kind == "one_way":
            one_way([(a, b)], send, recv)
        elif kind == "ping_pong":
            # round trips a -> b -> a back to back: the latency of a message in a
            # stream, without the skew of ranks leaving a barrier at different times
            for _ in range(PING_PONGS):
                if me == a:
                    t.send(send, b)
                    t.recv(recv, b)
                elif me == b:
                    t.recv(recv, a)
                    t.send(send, a)
        elif me in ((a, b) if kind == "exchange" else (a, b, a2, b2)):
            peer = {a: b, b: a, a2: b2, b2: a2}[me]
            t.sendrecv(send, peer, recv, peer)
        calls += 1

    probes = {(kind, n): (lambda kind=kind, n=n: probe(kind, n)) for n in LINK_SIZES
              for kind in kinds + (("ping_pong",) if n == LINK_SIZES[0] else ())}
    # each call a sample of its own, a barrier ahead of each: 5 a round below 1 MiB
    timings = interleaved(probes, rounds=reps, warmup=1, comm=t.comm, each_call=True,
                          calls={key: 1 if key[1] >= 1 << 20 else 5 for key in probes},
                          before=lambda key: t.barrier())
    messages = {"ping_pong": 2 * PING_PONGS}
    return {k: timings.median(k) / messages.get(k[0], 1) for k in sorted(probes)}


def fit_link(medians, flows):
    """inter_* fields from the probes' medians {(kind, bytes): s}.  x = bytes
    through one direction of the busiest link (a shared probe puts `flows`
    messages on it).  As calibrate does inside a host: alpha from the messages
    below 1 MiB, then per size the seconds per byte past it, (t - alpha) / x, for
    exchanges (beta_at: what a ring's step reads) and one way (beta_one_way_at),
    and one beta per kind at >= 1 MiB with alpha fixed (1/t weights).  alpha is
    Hockney's: half a ping-pong's round trip at the smallest size (below the
    token bucket's burst, net.BURST_S, the link's rate does not show; a line
    through two small sizes would extrapolate their noise to anything from 0 up)."""
    large = [n for n in LINK_SIZES if n >= LARGE]
    alpha = medians[("ping_pong", LINK_SIZES[0])]
    out = {"inter_alpha_s": alpha, "inter_bytes": LINK_SIZES, "inter_beta_bytes": large}
    for kind, through in (("one_way", 1), ("exchange", 1), ("shared", flows)):
        if (kind, LARGE) not in medians:
            continue
        out[f"inter_{kind}_s"] = [medians[(kind, n)] for n in LINK_SIZES]
        out[f"inter_beta_{kind}_s_per_byte"] = fit_beta([through * n for n in large],
                                                        [medians[(kind, n)] for n in large], alpha)
    out["inter_beta_s_per_byte"] = out["inter_beta_exchange_s_per_byte"]
    out["inter_beta_s_per_byte_at"] = [max(0.0, medians[("exchange", n)] - alpha) / n
                                       for n in large]
    out["inter_beta_one_way_s_per_byte_at"] = [max(0.0, medians[("one_way", n)] - alpha) / n
                                               for n in large]
    return out


def local_gamma():
    """With one rank a host: gamma alone, np.add per byte at calibrate's sizes."""
    x, y = np.ones(GAMMA_SIZES[-1] // 4, np.float32), np.ones(GAMMA_SIZES[-1] // 4, np.float32)
    per_byte = []
    for n in GAMMA_SIZES:
        seconds = []
        for _ in range(max(5, (64 << 20) // n)):
            start = time.perf_counter()
            np.add(x[:n // 4], y[:n // 4], out=x[:n // 4])
            seconds.append(time.perf_counter() - start)
        per_byte.append(float(np.median(seconds)) / n)
    return {"alpha_s": 0.0, "beta_s_per_byte": 0.0, "gamma_s_per_byte": per_byte[-1],
            "gamma_bytes": GAMMA_SIZES, "gamma_s_per_byte_at": per_byte}


def calibrate_hosts(reps, verify, mpi_part):
    """Under mpiexec on several hosts: both levels; rank 0 returns the record, others None.
    `mpi_part(reps, verify, comm=)`: calibrate.py's one-host measurement, handed in so
    that this module, which calibrate.py imports, does not import it back."""
    from mpi4py import MPI

    from allreduce.transport import MPITransport
    from allreduce.twolevel import host_layout
    comm = MPI.COMM_WORLD
    nodes, R = host_layout(comm)
    if R is None:
        raise SystemExit("calibrate: every host must hold as many ranks, consecutive ones "
                         "(block placement), as the cost model's schedules assume")
    if nodes < 2:
        raise SystemExit("calibrate: mpiexec started every rank on one host; for one host run "
                         "`python -m experiments.calibrate` without mpiexec (it starts its own)")
    t = MPITransport(comm)
    # 1. inside host 0 (ranks 0 and 1), while the other ranks wait in MPI
    pair = comm.Split(0 if R > 1 and comm.rank < 2 else MPI.UNDEFINED, comm.rank)
    intra = mpi_part(reps, verify, comm=pair) if pair != MPI.COMM_NULL else None
    t.barrier()
    if R == 1 and comm.rank == 0:
        intra = local_gamma()
    # 2. across the link between host 0 (ranks 0..R-1) and host 1 (R..2R-1)
    a, b = 0, R
    a2, b2 = (a + 1, b + 1) if R > 1 else (None, None)
    medians = link_part(t, a, b, a2, b2, max(3, reps))
    if comm.rank != 0:
        return None
    return {**intra, **fit_link(medians, 2), "inter_gbps": shaped_gbps(),
            "nodes": nodes, "ranks_per_node": R, "cores": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "provenance": provenance()}         # in a rank: asks this process's own MPI


def describe(cal):
    """One line: the link's figures beside the rate it is shaped to."""
    rate = 8 / cal["inter_beta_s_per_byte"] / 1e9
    shaped = f" (shaped to {cal['inter_gbps']:g})" if cal.get("inter_gbps") else ""
    kinds = ", ".join(f"{k.replace('_', ' ')} {8 / cal[f'inter_beta_{k}_s_per_byte'] / 1e9:.3f}"
                      for k in KINDS if cal.get(f"inter_beta_{k}_s_per_byte"))
    return (f"link: alpha {cal['inter_alpha_s'] * 1e3:.2f} ms, {rate:.3f} Gbit/s through a "
            f"host's link{shaped}; per kind {kinds} Gbit/s; {cal['nodes']} hosts x "
            f"{cal['ranks_per_node']} ranks")
