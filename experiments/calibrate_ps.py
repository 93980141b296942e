"""psrv's part of the calibration (experiments/calibrate.py runs it): one server and
W = 1, 2, 3 workers, push+pull of b bytes, the three interleaved block by block.
W = 1 gives ps_alpha and the round-trip curve T1(b) (ps_s), W = 2 what each further
worker adds, D(b) (ps_marginal_s; costmodel.psrv_time: t = T1 + (W - 1) D); W = 3 is
then predicted, not fitted (ps_verify)."""
import contextlib
import multiprocessing as mp

import numpy as np

from .fits import fit_two_regimes

PS_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
PS_WORKERS = (1, 2, 3)        # W = 1 fits T1(n), W = 2 fits D(n), W = 3 checks the two


def ps_worker(w, endpoints, barrier, results, reps):
    """One process of the psrv probe: a client of every server set with more than
    w workers; every (size, W) block starts at a barrier, so blocks alternate
    W = 1, 2, 3, 1, 2, 3, ... within seconds and the machine's drift hits all alike.
    Puts its samples {(W, n): [seconds per push+pull, a round each]} on `results`."""
    from allreduce.harness import interleaved
    from psrv.client import Client
    from psrv.config import OptimizerConfig
    clients = {W: Client(eps, w, W, timeout=120.0) for W, eps in endpoints.items() if w < W}
    params = {f"s{n}": np.zeros(n // 4, np.float32) for n in PS_SIZES}
    out = {k: np.empty_like(v) for k, v in params.items()}
    for c in clients.values():
        c.init(params, OptimizerConfig("sgd", lr=1e-9))
    step = {(W, k): 0 for W in clients for k in params}

    def push_pull(W, name):
        if W not in clients:             # a set this worker is not in: it only keeps the barriers
            return
        clients[W].push_pull({name: params[name]}, {name: out[name]}, step[(W, name)]).wait()
        step[(W, name)] += 1

    blocks = {(W, n): (lambda W=W, name=f"s{n}": push_pull(W, name))
              for n in PS_SIZES for W in endpoints}
    calls = {(W, n): max(5, min(100, int(8e7 / n))) for W, n in blocks}
    timings = interleaved(blocks, rounds=reps, warmup=1, calls=calls,
                          barrier=lambda: barrier.wait(120))
    results.put(timings.samples)
    for c in clients.values():
        c.close()


def ps_part(reps, verify=True):
    """psrv, one server, W = 1, 2 and 3 workers interleaved block by block.
    W = 1 gives ps_alpha and the round-trip curve T1(n); W = 2 what one more
    worker adds, D(n) (costmodel.psrv_time: t = T1 + (W - 1) D); W = 3 is then
    predicted, not fitted: ps_verify."""
    from allreduce.harness import Timings, slowest
    from psrv.launch import start_local_servers
    from psrv.measure import collect
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    workers = PS_WORKERS if verify else PS_WORKERS[:2]
    with contextlib.ExitStack() as stack:
        endpoints = {W: stack.enter_context(start_local_servers(1, worker_timeout=60)).endpoints
                     for W in workers}
        barrier = ctx.Barrier(max(workers))
        procs = [ctx.Process(target=ps_worker, args=(w, endpoints, barrier, results, reps))
                 for w in range(max(workers))]
        for p in procs:
            p.start()
        # the slowest worker, round by round (one outside a set adds nothing: it times 0)
        timings = slowest(Timings(s) for s in collect(results, len(procs), procs))
        for p in procs:
            p.join(60)
    seconds = [timings.median((1, n)) for n in PS_SIZES]
    alpha, two_beta = fit_two_regimes(PS_SIZES, seconds)
    # what the second worker adds, from W=2 minus W=1 of the same rep (drift cancels)
    marginal = [max(0.0, float(np.median(np.subtract(timings.samples[(2, n)],
                                                     timings.samples[(1, n)]))))
                for n in PS_SIZES]
    median = {(W, n): timings.median((W, n)) for W in workers for n in PS_SIZES}
    return {"ps_alpha_s": alpha, "ps_beta_s_per_byte": two_beta / 2, "ps_bytes": PS_SIZES,
            "ps_s": seconds, "ps_marginal_s": marginal,
            "ps_measured": [{"workers": W, "servers": 1, "bytes": n, "time_us": t * 1e6}
                            for (W, n), t in median.items()],
            "ps_verify": [{"workers": W, "servers": 1, "bytes": n, "time_us": t * 1e6}
                          for (W, n), t in median.items() if W > 2]}
