"""--sync ring: SIGINT/SIGTERM end the run as they end a ps run (stopping.py): the workers
agree on one step, write the checkpoint of that step, print one line and exit 128 + the
signal, with no traceback; --resume goes on from that step with every step recorded once.

Tier (c): real mpiexec runs of 3 ranks (an odd size on purpose).  The signal goes to
mpiexec, which forwards it to every rank, as Ctrl-C does, once the first checkpoint is on
disk, so it lands mid-run at whatever step: the tests check what holds at any step.
"""
import re
import signal

import pytest
import torch
from conftest import mpirun
from test_ps_checkpoint_signal import signalled_run, steps_of_rank

RANKS = 3
TRAIN = ["-m", "strategies.train", "--sync", "ring", "--model", "mlp", "--width", "8",
         "--depth", "1", "--in-dim", "4", "--classes", "3", "--dataset-size", "96",
         "--global-batch", "12", "--threads", "1", "--no-progress", "--seed", "3"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("signum", [
    pytest.param(signal.SIGINT, id="SIGINT"),
    pytest.param(signal.SIGTERM, id="SIGTERM", marks=pytest.mark.slow)])
def test_a_signal_ends_a_ring_run_at_one_step_with_its_checkpoint(tmp_path, signum):
    ckpt, jsonl = tmp_path / "ckpt", str(tmp_path / "run.jsonl")
    flags = ["--checkpoint-dir", ckpt, "--checkpoint-every", "4", "--jsonl", jsonl]
    rc, out, err = signalled_run(flags + ["--steps", "100000"], ckpt, signum, train=TRAIN,
                                 workers=RANKS - 1)
    assert rc == 128 + signum, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    stops = re.findall(rf"stopped by {signum.name} after step (\d+) of 100000; checkpoint of "
                       rf"step (\d+)", err)
    assert len(stops) == 1 and stops[0][0] == stops[0][1], err[-3000:]     # one line
    step = int(stops[0][0])
    assert torch.load(ckpt / "checkpoint.pt", weights_only=True)["step"] == step
    for rank in range(RANKS):                    # the records flushed up to the stop
        assert steps_of_rank(jsonl, rank) == list(range(step)), rank
    resumed = mpirun(RANKS, TRAIN + flags + ["--steps", step + 2, "--resume"], 150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed at step {step}" in resumed.stdout
    for rank in range(RANKS):                    # every step once, none lost or repeated
        assert steps_of_rank(jsonl, rank) == list(range(step + 2)), rank
