"""Tier (c): what a step means, probed through real server processes and real clients.

    a crash is not a finish     an exception inside `with Client(...)` sends ABORT; under
                                BSP and on_worker_death='fail' the others fail, naming it
    no early push               a BSP push for step t+1 while step t is open is refused
    nothing after BYE           a closed worker's push is refused
    checkpoints count steps     --checkpoint-every N is N steps of every worker, in any mode
    resume from uneven clocks   keys saved at different steps (SSP/ASP) resume exactly once
    SIGINT / SIGTERM            the server writes its final checkpoint and exits 0

Gradients are small multiples of 1/8 and lr a power of two, so every sum is exact in
float32 and results compare with `==` whatever order the server applied them in.
"""
import os
import signal
import threading
import time

import numpy as np
import pytest

import psrv

SHAPES = {"w": (6, 4), "b": (4,)}


def start_params():
    return {n: (np.arange(np.prod(s), dtype=np.float32).reshape(s) % 5) / 4 for n, s in SHAPES.items()}


def grads(step, w):
    """Position-, step- and worker-dependent multiples of 1/8 (never all ones)."""
    return {n: ((np.arange(np.prod(s)) % 4 - 1.5) * 0.25 * (1 + (step + 2 * w) % 3)
                ).astype(np.float32).reshape(s) for n, s in SHAPES.items()}


def expected(pushes, lr, scale):
    """start - lr * scale * (sum of every (step, worker) gradient), in float64 (exact here)."""
    out = {n: p.astype(np.float64) for n, p in start_params().items()}
    for step, w in pushes:
        for n, g in grads(step, w).items():
            out[n] -= lr * scale * g
    return out


def client(servers, w, num_workers, mode="bsp", timeout=10):
    return psrv.Client(servers.endpoints, w, num_workers, timeout=timeout,
                       consistency=psrv.Consistency(mode, 1 if mode == "ssp" else 0))


SGD = psrv.OptimizerConfig("sgd", lr=0.5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["fail", "continue"])
def test_an_exception_inside_with_is_a_crash_not_a_clean_exit(policy):
    with psrv.launch.start_local_servers(2, worker_timeout=10, on_worker_death=policy) as servers:
        ready = threading.Event()

        def crashing_worker():
            with pytest.raises(RuntimeError), client(servers, 1, 2) as c:
                params = start_params()
                c.init(params, SGD)
                c.push_pull(grads(0, 1), params, 0).wait()
                ready.set()
                raise RuntimeError("boom in the forward pass")

        t = threading.Thread(target=crashing_worker)
        t.start()
        c0, params = client(servers, 0, 2), start_params()
        c0.init(params, SGD)
        c0.push_pull(grads(0, 0), params, 0).wait()
        assert ready.wait(10)
        t.join(10)
        began = time.monotonic()
        if policy == "fail":      # every shard names worker 1, at once, not after the timeout
            with pytest.raises(psrv.PSError, match=r"worker 1 exited with an error \(RuntimeError: "
                                                   r"boom in the forward pass\).*fails the bsp run"):
                c0.push_pull(grads(1, 0), params, 1).wait()
            assert time.monotonic() - began < 5
        else:                     # the survivor goes on alone
            c0.push_pull(grads(1, 0), params, 1).wait()
        c0.close()
        assert servers.wait(30) == [0, 0]
        assert "worker 1 exited with an error" in servers.log(0)


@pytest.mark.timeout(60)
def test_an_early_push_is_refused_and_changes_no_step():
    """W=2, SGD lr 0.1, w = 0: worker 0 pushes 1 for step 0, then 2 for step 1 before
    worker 1 pushed step 0.  Step 0 must move w by lr * (1 + 1) / 2 = 0.1, not 0.2."""
    with psrv.launch.start_local_servers(1, worker_timeout=30) as servers:
        c0, c1 = client(servers, 0, 2), client(servers, 1, 2)
        params = {"w": np.zeros(4, np.float32)}
        c0.init(params, psrv.OptimizerConfig("sgd", lr=0.1))
        c1.init({"w": np.zeros(4, np.float32)}, psrv.OptimizerConfig("sgd", lr=0.1))
        ones = np.ones(4, np.float32)
        c0.push("w", ones, 0)
        with pytest.raises(psrv.PSError, match=r"worker 0 pushed step 1 while step 0 is still open "
                                               r"\(waiting for workers \[1\]\)"):
            c0.push("w", 2 * ones, 1)
        c1.push("w", ones, 0)
        c0.pull("w", params["w"])
        np.testing.assert_array_equal(params["w"], np.float32(0) - np.float32(0.1) * ones)
        c0.push("w", 2 * ones, 1)                  # step 1 is open now
        c1.push("w", 2 * ones, 1)
        c0.pull("w", params["w"])
        np.testing.assert_array_equal(params["w"], np.float32(-0.1) - np.float32(0.1) * 2 * ones)
        c0.close()
        c1.close()


@pytest.mark.timeout(60)
def test_a_push_after_bye_is_refused():
    with psrv.launch.start_local_servers(1, worker_timeout=30) as servers:
        c0, c1 = client(servers, 0, 2, "asp"), client(servers, 1, 2, "asp")
        params = start_params()
        c0.init(params, SGD)
        c1.init(start_params(), SGD)
        c1._call(0, psrv.protocol.Op.BYE)          # what close() sends, sockets kept open
        with pytest.raises(psrv.PSError, match="worker 1 has closed"):
            c1.push("w", grads(0, 1)["w"], 0)
        c0.push_pull(grads(0, 0), params, 0).wait()
        for n, v in expected([(0, 0)], 0.5, 0.5).items():     # worker 1's push left no trace
            np.testing.assert_array_equal(params[n], v)
        c1.close()
        c0.close()


@pytest.mark.timeout(60)
def test_checkpoint_every_counts_steps_of_every_worker(tmp_path):
    """ASP, W=2, every 3: three steps of worker 0 and one of worker 1 are 4 versions
    but 1 step; the file appears once both did 3."""
    path = tmp_path / "shard0-of-1.npz"
    with psrv.launch.start_local_servers(1, worker_timeout=30, checkpoint_dir=str(tmp_path),
                                         checkpoint_every=3) as servers:
        cs = [client(servers, w, 2, "asp") for w in range(2)]
        ps = [start_params() for _ in cs]
        for c, p in zip(cs, ps):
            c.init(p, SGD)
        for step in range(3):
            cs[0].push_pull(grads(step, 0), ps[0], step).wait()
        cs[1].push_pull(grads(0, 1), ps[1], 0).wait()
        assert not path.exists()
        for step in (1, 2):
            cs[1].push_pull(grads(step, 1), ps[1], step).wait()
        assert path.exists()
        for c in cs:
            c.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["ssp", pytest.param("asp", marks=pytest.mark.slow)])
def test_resume_when_keys_were_saved_at_different_steps(tmp_path, mode):
    """Worker 0 pushed step 3 of w but not of b when the shard saved: it resumes at
    step 3, its second push of w for step 3 is skipped, and every gradient lands once."""
    opts = dict(worker_timeout=30, checkpoint_dir=str(tmp_path))
    with psrv.launch.start_local_servers(1, **opts) as servers:
        cs = [client(servers, w, 2, mode, timeout=2) for w in range(2)]
        ps = [start_params() for _ in cs]
        for c, p in zip(cs, ps):
            c.init(p, SGD)
        for step in range(3):
            for w in range(2):
                cs[w].push_pull(grads(step, w), ps[w], step).wait()
        cs[0].push("w", grads(3, 0)["w"], 3)
        cs[0].checkpoint()
        servers.kill(0)
        for c in cs:
            c.close()
    with psrv.launch.start_local_servers(1, resume=True, **opts) as servers:
        cs = [client(servers, w, 2, mode) for w in range(2)]
        ps = [{n: np.zeros(s, np.float32) for n, s in SHAPES.items()} for _ in cs]
        assert [c.init(p, SGD) for c, p in zip(cs, ps)] == [3, 3]
        for step in range(3, 6):
            for w in range(2):
                cs[w].push_pull(grads(step, w), ps[w], step).wait()
        for n, v in expected([(s, w) for s in range(6) for w in range(2)], 0.5, 0.5).items():
            np.testing.assert_array_equal(ps[1][n], v)
        for c in cs:
            c.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGTERM,
                                    pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_writes_the_final_checkpoint_and_a_half_pushed_step_is_pushed_again(
        tmp_path, signum):
    opts = dict(worker_timeout=30, checkpoint_dir=str(tmp_path))
    with psrv.launch.start_local_servers(1, **opts) as servers:
        cs = [client(servers, w, 2, timeout=2) for w in range(2)]
        ps = [start_params() for _ in cs]
        for c, p in zip(cs, ps):
            c.init(p, SGD)
        for step in range(2):
            handles = [c.push_pull(grads(step, w), ps[w], step) for w, c in enumerate(cs)]
            for h in handles:
                h.wait()
        waiting = cs[0].push_pull(grads(2, 0), ps[0], 2)        # step 2 half pushed
        time.sleep(0.3)
        servers.procs[0].send_signal(signum)
        with pytest.raises(psrv.PSError, match=f"stopped by {signum.name}"):
            waiting.wait()                                      # told at once, not timed out
        assert servers.wait(20) == [0]
        assert "final checkpoint" in servers.log(0)
        for c in cs:
            c.close()
    assert os.listdir(tmp_path) == ["shard0-of-1.npz"]
    with psrv.launch.start_local_servers(1, resume=True, **opts) as servers:
        cs = [client(servers, w, 2) for w in range(2)]
        ps = [{n: np.zeros(s, np.float32) for n, s in SHAPES.items()} for _ in cs]
        assert [c.init(p, SGD) for c, p in zip(cs, ps)] == [2, 2]   # step 2 again
        for step in range(2, 4):
            handles = [c.push_pull(grads(step, w), ps[w], step) for w, c in enumerate(cs)]
            for h in handles:
                h.wait()
        for n, v in expected([(s, w) for s in range(4) for w in range(2)], 0.5, 0.5).items():
            np.testing.assert_array_equal(ps[0][n], v)
        for c in cs:
            c.close()
