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
  world exists before any split is asked for.
* `--sync torch` on dp x tp, dp x pp and pp x tp grids reproduces `--sync local`
  on one process, with the tolerance of tests/test_parallel_runs.py (rtol 1e-5,
  atol 1e-6: only the order of float additions may differ; a collective over
  the wrong ranks moves the first loss by ~2e-2).
"""
import json

import pytest

from conftest import check_ok, mpirun
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


@pytest.mark.timeout(400)
def test_every_algorithm_over_torch_on_a_split_communicator():
    result = check_ok(mpirun(3, ["tests/mpi/collectives_matrix.py", json.dumps(SPLIT_SPECS)],
                             timeout=300))
    assert "OK P=3" in result.stdout
    assert result.stdout.count("checked ") == len(SPLIT_SPECS)


GRIDS = [
    ("dp2_tp2", GPT + ["--sync", "torch", "--dp", "2", "--tp", "2"]),
    ("dp2_pp2", GPT + ["--sync", "torch", "--dp", "2", "--pp", "2", "--micro-batches", "2"]),
    ("pp2_tp2", GPT + ["--sync", "torch", "--pp", "2", "--tp", "2", "--micro-batches", "2",
                       "--schedule", "gpipe"]),
]


@pytest.mark.timeout(500)
def test_torch_sync_on_a_grid_reproduces_one_process(tmp_path):
    reference = launch(tmp_path, 1, [("local", GPT + ["--sync", "local"])])["local"]
    runs = launch(tmp_path, 4, GRIDS, timeout=300)
    for name, _ in GRIDS:
        assert_same_run(runs[name], reference, 4)
