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


@pytest.mark.timeout(100)
def test_an_exception_in_the_loop_is_a_crash_the_servers_and_workers_hear_of():
    # worker 1 raises in step 2; under hybrid it is the leader of its node of 1
    argvs = [TINY + ["--steps", "4"] + extra for extra in RUNS.values()]
    result = check_ok(mpirun(3, ["tests/mpi/train_fault.py", 1, 2, json.dumps(argvs)],
                             timeout=90))
    out, err = result.stdout.splitlines(), result.stderr
    crash = "worker 1 exited with an error (RuntimeError: injected fault at step 2)"
    for run, sync in enumerate(RUNS):
        ended = {rank: next((line.split(": ", 1)[1] for line in out
                             if line.startswith(f"rank {rank} run {run}: ")), None)
                 for rank in range(3)}
        assert None not in ended.values(), (sync, ended, "\n".join(out)[-2000:], err[-3000:])
        assert ended[1] == "raised RuntimeError: injected fault at step 2", (sync, ended)
        assert ended[0].startswith("raised PSError: worker 0: server 0") and \
            f"refused PUSH_PULL: {crash}; shard 0 fails the bsp run" in ended[0], (sync, ended)
        assert ended[SERVER] == "finished", (sync, ended)
    warnings = [line for line in err.splitlines()
                if line.startswith(f"rank {SERVER} psrv.server WARNING")]
    assert warnings.count(f"rank {SERVER} psrv.server WARNING shard 0: {crash}") == 2, err[-3000:]
