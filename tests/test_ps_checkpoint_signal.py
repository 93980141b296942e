"""Checkpoint sets under --sync ps: SIGINT/SIGTERM end the run with a set of ONE step,
and --resume takes the newest complete set.

A --sync ps checkpoint is a set: each server's part of step s
(ps/shardI-of-N-steps.npz) and the workers' checkpoint.pt, written last
(strategies/runtime/checkpoint/resume.py, psrv/checkpoints.py).  Tier (c): real mpiexec runs of
3 workers and 1 server.  The signal goes to mpiexec, which forwards it to every
rank, as Ctrl-C does; it is sent once the first set is on disk, so it lands
mid-run, at whatever step: the tests check what must hold at any step (the
stop's step is the set's step, every step is recorded once), not when it came.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psrv
import pytest
import torch
from conftest import MPIEXEC, ROOT, mpi_env, mpirun

from allreduce.records import read_jsonl

WORKERS = 3
TRAIN = ["-m", "strategies.train", "--sync", "ps", "--servers", "1", "--model", "mlp",
         "--width", "8", "--depth", "1", "--in-dim", "4", "--classes", "3",
         "--dataset-size", "96", "--global-batch", "12", "--threads", "1", "--no-progress",
         "--seed", "3"]


def set_steps(ckpt):
    """(the workers' checkpoint step, the steps of the server's parts on disk)."""
    worker = torch.load(ckpt / "checkpoint.pt", weights_only=True)["step"]
    parts = sorted(int(m.group(1)) for m in map(re.compile(r"shard0-of-1-step(\d+)\.npz")
                                                .fullmatch, os.listdir(ckpt / "ps")) if m)
    return worker, parts


def steps_of_rank(jsonl, rank):
    return sorted(r["step"] for r in read_jsonl(jsonl, warn=False)
                  if r.get("kind") == "step" and r["rank"] == rank)


def signalled_run(flags, ckpt, signum, timeout=150, train=TRAIN, workers=WORKERS):
    """Train until the first checkpoint set is there, then send `signum` to mpiexec."""
    cmd = [MPIEXEC, "-n", str(workers + 1), sys.executable, "-m", "mpi4py", *train, *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=mpi_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not (ckpt / "checkpoint.pt").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, out, err


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode,signum", [
    pytest.param("bsp", signal.SIGINT, id="bsp-SIGINT"),
    pytest.param("ssp", signal.SIGTERM, id="ssp-SIGTERM", marks=pytest.mark.slow),
    pytest.param("asp", signal.SIGINT, id="asp-SIGINT", marks=pytest.mark.slow)])
def test_a_signal_ends_the_run_with_one_set_and_resume_finishes(tmp_path, mode, signum):
    ckpt, jsonl = tmp_path / "ckpt", str(tmp_path / "run.jsonl")
    flags = ["--consistency", mode, "--checkpoint-dir", ckpt, "--checkpoint-every", "4",
             "--jsonl", jsonl]
    rc, out, err = signalled_run(flags + ["--steps", "100000"], ckpt, signum)
    assert rc == 128 + signum, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    stop = re.search(rf"stopped by {signum.name} after step (\d+) of 100000; checkpoint of "
                     rf"step (\d+)", err)
    assert stop and stop.group(1) == stop.group(2), err[-3000:]
    step = int(stop.group(1))
    worker, parts = set_steps(ckpt)
    assert worker == step == parts[-1] and len(parts) <= 2, (worker, parts)
    for rank in range(WORKERS):                  # the records flushed up to the stop
        assert steps_of_rank(jsonl, rank) == list(range(step)), rank
    resumed = mpirun(WORKERS + 1, TRAIN + flags + ["--steps", step + 3, "--resume"], 150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed at step {step}" in resumed.stdout and "note:" not in resumed.stderr
    for rank in range(WORKERS):                  # every step once, none lost or repeated
        assert steps_of_rank(jsonl, rank) == list(range(step + 3)), rank
    assert set_steps(ckpt)[0] == step + 3


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hybrid_stops_at_one_step_too(tmp_path):
    """--sync hybrid: two nodes of two workers, their leaders on the server; SIGINT
    ends the run with the set of one step and no traceback, and --resume goes on."""
    ckpt, jsonl = tmp_path / "ckpt", str(tmp_path / "run.jsonl")
    train = [a for a in TRAIN] + ["--ranks-per-node", "2"]
    train[train.index("ps")] = "hybrid"
    flags = ["--checkpoint-dir", ckpt, "--checkpoint-every", "4", "--jsonl", jsonl]
    rc, out, err = signalled_run(flags + ["--steps", "100000"], ckpt, signal.SIGINT,
                                 train=train, workers=4)
    assert rc == 130 and "Traceback" not in err, err[-3000:]
    stop = re.search(r"stopped by SIGINT after step (\d+) of 100000; checkpoint of step (\d+)",
                     err)
    assert stop and stop.group(1) == stop.group(2), err[-3000:]
    step = int(stop.group(1))
    worker, parts = set_steps(ckpt)
    assert worker == step == parts[-1], (worker, parts)
    resumed = mpirun(5, train + flags + ["--steps", step + 2, "--resume"], 150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed at step {step}" in resumed.stdout
    for rank in range(4):                        # every step once, none lost or repeated
        assert steps_of_rank(jsonl, rank) == list(range(step + 2)), rank


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_falls_back_to_the_newest_complete_set_and_refuses_without_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", ckpt, "--checkpoint-every", "2"]
    first = mpirun(WORKERS + 1, TRAIN + flags + ["--steps", 4], 150)
    assert first.returncode == 0, first.stderr[-3000:]
    assert set_steps(ckpt) == (4, [2, 4])
    # a server's part from a later step than the workers' file: a run stopped between them
    shutil.copy(ckpt / "ps" / "shard0-of-1-step4.npz", ckpt / "ps" / "shard0-of-1-step6.npz")
    resumed = mpirun(WORKERS + 1, TRAIN + flags + ["--steps", 6, "--resume"], 150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    notes = [line for line in resumed.stderr.splitlines() if "note:" in line]
    assert len(notes) == WORKERS + 1, resumed.stderr           # one line on every rank
    for rank in range(WORKERS + 1):
        assert any(n.startswith(f"strategies.train rank {rank}: note: --resume: the checkpoint "
                                f"set of step 6 is incomplete") and
                   n.endswith("resuming from step 4, the newest complete set") for n in notes)
    assert "resumed at step 4" in resumed.stdout
    assert set_steps(ckpt) == (6, [4, 6])       # the real step 6 replaced the stray part
    # no complete set at all: the workers' file names step 6, whose server part is gone
    os.remove(ckpt / "ps" / "shard0-of-1-step6.npz")
    refused = mpirun(WORKERS + 1, TRAIN + flags + ["--steps", 8, "--resume"], 150)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    for rank in range(WORKERS + 1):
        assert re.search(rf"strategies.train rank {rank}: error: --resume: no complete "
                         rf"checkpoint set in \S+: \S+checkpoint.pt is of step 6, the servers' "
                         rf"parts are of steps shard 0: 4\n", refused.stderr), refused.stderr


SHAPES = {"w": (6, 4), "b": (4,)}
SGD = psrv.OptimizerConfig("sgd", lr=0.5)


@pytest.mark.timeout(60)
def test_a_shard_writes_a_part_per_step_asked_for_and_keeps_the_last_two(tmp_path):
    with psrv.launch.start_local_servers(1, worker_timeout=30, checkpoint_dir=tmp_path) \
            as servers:
        cs = [psrv.Client(servers.endpoints, w, 2, timeout=10) for w in range(2)]
        params = [{n: np.ones(s, np.float32) for n, s in SHAPES.items()} for _ in cs]
        for c, p in zip(cs, params):
            c.init(p, SGD)
        for step in range(6):
            for h in [c.push_pull({n: np.full(s, w + 1, np.float32) for n, s in SHAPES.items()},
                                  params[w], step) for w, c in enumerate(cs)]:
                h.wait()
            if step % 2:
                assert cs[0].checkpoint(step + 1) == [str(tmp_path / f"shard0-of-1-step"
                                                                     f"{step + 1}.npz")]
        assert sorted(os.listdir(tmp_path)) == ["shard0-of-1-step4.npz", "shard0-of-1-step6.npz"]
        # a set is of one step: the shard refuses a step its workers are not at
        with pytest.raises(psrv.PSError, match="a checkpoint of step 7 was asked for, but "
                                               "worker 0 is at step 6 on key"):
            cs[1].checkpoint(7)
        assert cs[1].checkpoint() == [str(tmp_path / "shard0-of-1.npz")]   # its own file
        for c in cs:
            c.close()
