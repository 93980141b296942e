"""Tier (c): a worker whose training loop raises tells the parameter servers it crashed.

strategies.train closes the psrv client with the error (ABORT), not with a clean BYE.
After a BYE a BSP server stops waiting for that worker, and the others would train on
without it to the end, on the average of fewer gradients; after an ABORT the server
fails the run and every other worker gets an error naming the crashed one.
"""
import json

import pytest

from conftest import check_ok, mpirun
from test_train_runs import TINY

SERVER = 2               # 2 workers + 1 server: the last rank serves
RUNS = {"ps": ["--sync", "ps", "--servers", "1"],
        "hybrid": ["--sync", "hybrid", "--servers", "1", "--ranks-per-node", "1"]}


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_an_exception_in_the_loop_is_a_crash_the_servers_and_workers_hear_of(tmp_path):
    # worker 1 raises in step 2; under hybrid it is the leader of its node of 1
    argvs = [TINY + ["--steps", "4"] + extra for extra in RUNS.values()]
    result = check_ok(mpirun(3, ["tests/mpi/train_fault.py", 1, 2, json.dumps(argvs),
                                 tmp_path], timeout=90))
    err = result.stderr
    ended = {rank: (tmp_path / f"rank-{rank}.txt").read_text().splitlines()
             for rank in range(3)}
    crash = "worker 1 exited with an error (RuntimeError: injected fault at step 2)"
    assert all(len(runs) == len(RUNS) for runs in ended.values()), (ended, err[-3000:])
    for run, sync in enumerate(RUNS):
        assert ended[1][run] == "raised RuntimeError: injected fault at step 2", (sync, ended)
        assert ended[0][run].startswith("raised PSError: worker 0: server 0") and \
            f"refused PUSH_PULL: {crash}; shard 0 fails the bsp run" in ended[0][run], \
            (sync, ended)
        assert ended[SERVER][run] == "finished", (sync, ended)
    # counted in the whole text: another rank's line may run into it
    assert err.count(f"rank {SERVER} psrv.server WARNING shard 0: {crash}") == 2, err[-3000:]
