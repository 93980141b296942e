"""Faults end in clear errors within the timeout; checkpoints resume bit for bit.

The test process itself is worker 0 (a real client with real sockets); other
workers are spawned processes that the tests SIGKILL.
"""
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import psrv

SHAPES = {"w": (64, 32), "b": (32,)}
SGD = psrv.OptimizerConfig("sgd", lr=0.05, momentum=0.9)


def start_params():
    return {n: (np.arange(np.prod(s), dtype=np.float32).reshape(s) % 7) / 7 for n, s in SHAPES.items()}


def fake_grads(params, step, w):
    """Deterministic, position- and worker-dependent gradients (never all ones)."""
    return {n: np.sin(p + 0.1 * step + w).astype(np.float32) for n, p in params.items()}


def run_steps(client, params, first, last, w=0):
    for step in range(first, last):
        client.push_pull(fake_grads(params, step, w), params, step).wait()


def doomed_worker(endpoints, steps_done):
    """Worker 1: trains two steps, then hangs until the test kills it."""
    client = psrv.Client(endpoints, 1, 2, timeout=30)
    params = start_params()
    client.init(params, SGD)
    run_steps(client, params, 0, 2, w=1)
    steps_done.set()
    time.sleep(600)


def start_doomed(endpoints):
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    proc = ctx.Process(target=doomed_worker, args=(endpoints, done))
    proc.start()
    return proc, done


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["fail", pytest.param("continue", marks=pytest.mark.slow)])
def test_killed_worker_under_bsp(policy):
    with psrv.launch.start_local_servers(2, worker_timeout=2.5, on_worker_death=policy) as servers:
        proc, done = start_doomed(servers.endpoints)
        client = psrv.Client(servers.endpoints, 0, 2, timeout=20)
        params = start_params()
        client.init(params, SGD)
        run_steps(client, params, 0, 2)
        assert done.wait(30)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t = time.monotonic()
        if policy == "fail":
            with pytest.raises(psrv.PSError, match=r"worker 1 sent nothing for .* fails the bsp run"):
                run_steps(client, params, 2, 3)
            assert time.monotonic() - t < 15           # found by heartbeat timeout, not hung
        else:
            before = {n: p.copy() for n, p in params.items()}
            run_steps(client, params, 2, 5)            # worker 0 alone from now on
            assert time.monotonic() - t < 15
            assert not np.allclose(before["w"], params["w"])
        client.close()
        assert servers.wait(30) == [0, 0]
        assert "worker 1 sent nothing" in servers.log(0)


@pytest.mark.timeout(60)
def test_killed_server_gives_a_clear_error_within_the_timeout():
    with psrv.launch.start_local_servers(2, worker_timeout=30) as servers:
        client = psrv.Client(servers.endpoints, 0, 1, timeout=2.0)
        params = start_params()
        client.init(params, SGD)
        run_steps(client, params, 0, 2)
        servers.kill(1)
        t = time.monotonic()
        with pytest.raises(psrv.PSError, match=r"server 1 .* sent no reply .* within 2 s"):
            run_steps(client, params, 2, 3)
        assert 1.5 < time.monotonic() - t < 6
        client.close()


@pytest.mark.timeout(90)
def test_checkpoint_restart_resumes_with_the_same_parameters(tmp_path):
    # the uninterrupted run
    with psrv.launch.start_local_servers(2, worker_timeout=30) as servers:
        with psrv.Client(servers.endpoints, 0, 1, timeout=20, slice_bytes=2048) as client:
            reference = start_params()
            client.init(reference, SGD)
            run_steps(client, reference, 0, 10)
    # 6 steps, checkpoint after every one, kill both servers, restart with --resume
    opts = dict(worker_timeout=30, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    with psrv.launch.start_local_servers(2, **opts) as servers:
        client = psrv.Client(servers.endpoints, 0, 1, timeout=3, slice_bytes=2048)
        params = start_params()
        client.init(params, SGD)
        run_steps(client, params, 0, 6)
        at_kill = {n: p.copy() for n, p in params.items()}
        servers.kill(0)
        servers.kill(1)
        client.close()                                  # best effort: nobody answers BYE
    assert sorted(os.listdir(tmp_path)) == ["shard0-of-2.npz", "shard1-of-2.npz"]  # no temp left
    with psrv.launch.start_local_servers(2, resume=True, **opts) as servers:
        with psrv.Client(servers.endpoints, 0, 1, timeout=20, slice_bytes=2048) as client:
            params = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
            start = client.init(params, SGD)
            assert start == 6
            for n in params:                          # the servers' values, not the zeros
                np.testing.assert_array_equal(params[n], at_kill[n])
            run_steps(client, params, start, 10)       # momentum buffers came back too
            assert client.checkpoint() == [str(tmp_path / f"shard{i}-of-2.npz") for i in range(2)]
    for n in params:
        np.testing.assert_array_equal(params[n], reference[n])
