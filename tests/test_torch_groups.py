"""Tiers (b) and (c): the torch transport over sub-communicators.

torch.distributed's world is the whole launch; a transport over a communicator
runs on a process group of that communicator's ranks, in its rank order
(allreduce/torch_transport.py).  Two checks, both with real processes:

* every textbook algorithm and the torch baseline over the torch transport on a
  split of COMM_WORLD, against the independent reference of
  tests/mpi/collectives_matrix.py (same inputs and tolerances): world ranks of
  equal parity (sub-communicators of 2 and 1 ranks at P = 3), and all ranks in
  reverse order (group rank r is world rank 2 - r, so a peer or root left
  untranslated shows).  The first spec runs on the whole world, so the torch
  world exists before any split is asked for.  The same launch checks the
  holding of messages that CUDA tensors get for NCCL (posted in one batch at
  the next wait: TorchTransport.holds), here with every message held, on gloo.
* `--sync torch` on dp x tp, dp x pp and pp x tp grids reproduces `--sync local`
  on one process, with the tolerance of tests/test_parallel_runs.py (rtol 1e-5,
  atol 1e-6: only the order of float additions may differ; a collective over
  the wrong ranks moves the first loss by ~2e-2).
"""
import json
import time

import pytest

from conftest import BIN, check_ok, mpi_env, mpirun, run
from test_parallel_runs import GPT, assert_same_run, launch

TORCH = {"transport": "torch"}
SPLIT_SPECS = [
    {"algo": "ring", **TORCH},
    *({"algo": algo, **TORCH, "split": split}
      for algo in ("ring", "tree", "halving_doubling") for split in ("parity", "reversed")),
    {"algo": "hierarchical", **TORCH, "split": "reversed",        # nodes [2, 1] and [0]
     "options": {"ranks_per_node": 2, "inner": "ring", "outer": "tree"}},
    {"algo": "hierarchical", **TORCH, "split": "parity",          # nodes [0] and [2]
     "options": {"ranks_per_node": 1, "inner": "halving_doubling", "outer": "ring"}},
    {"algo": "torch", "split": "parity"},                         # every dtype: not quick
    {"algo": "torch", "split": "reversed"},
]
HELD_SPECS = [
    {"algo": "ring", **TORCH, "hold": True, "split": "reversed"},
    {"algo": "tree", **TORCH, "hold": True, "split": "reversed"},
    {"algo": "halving_doubling", **TORCH, "hold": True},
    {"algo": "hierarchical", **TORCH, "hold": True,
     "options": {"ranks_per_node": 2, "inner": "tree", "outer": "ring"}},
]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_algorithm_over_torch_on_a_split_communicator():
    specs = SPLIT_SPECS + HELD_SPECS
    result = check_ok(mpirun(3, ["tests/mpi/collectives_matrix.py", json.dumps(specs)],
                             timeout=300))
    assert "OK P=3" in result.stdout
    assert result.stdout.count("checked ") == len(specs)


GRIDS = [
    ("dp2_tp2", GPT + ["--sync", "torch", "--dp", "2", "--tp", "2"]),
    ("dp2_pp2", GPT + ["--sync", "torch", "--dp", "2", "--pp", "2", "--micro-batches", "2"]),
    ("pp2_tp2", GPT + ["--sync", "torch", "--pp", "2", "--tp", "2", "--micro-batches", "2",
                       "--schedule", "gpipe"]),
]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_torch_sync_on_a_grid_reproduces_one_process(tmp_path):
    reference = launch(tmp_path, 1, [("local", GPT + ["--sync", "local"])])["local"]
    runs = launch(tmp_path, 4, GRIDS, timeout=300)
    for name, _ in GRIDS:
        assert_same_run(runs[name], reference, 4)


@pytest.mark.timeout(120)
def test_a_group_made_by_some_ranks_only_ends_in_an_error_not_a_hang():
    """torch makes a group with every rank of the world; rank 1 never comes."""
    start = time.monotonic()
    result = mpirun(2, ["tests/mpi/torch_group_fault.py"], timeout=100, TOPOLAB_TIMEOUT=3)
    assert result.returncode != 0 and "no error" not in result.stdout
    assert "made by all 2 ranks of the launch together; not all came within 3 s" in result.stderr
    assert time.monotonic() - start < 60


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_groups_given_as_rank_lists_under_torchrun():
    """No MPI: each rank passes its own group's global ranks ([2, 0] and [1]); a
    list naming a rank that does not exist is refused on every rank."""
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "3",
           "tests/mpi/torchrun_groups.py"]
    result = check_ok(run(cmd, 180, mpi_env(OMP_NUM_THREADS=1)))
    assert result.stdout.count(" ok in group ") == 3
    assert result.stdout.count(" refused a bad group") == 3
