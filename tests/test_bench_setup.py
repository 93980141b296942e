"""What allreduce.bench settles before any work: NCCL's GPUs and the memory its sizes need.

Tier (a): the decisions as pure functions (allreduce.gpus, allreduce.bench_config),
since a host whose ranks outnumber its GPUs, or one with terabytes of memory,
is not at hand.  Tier (c): `--sizes 1T` under mpiexec stops every rank with one
line and exit status 2, before allocating anything.
"""
import re

import pytest

from allreduce.bench_config import memory_needed, nccl_rows, parse_args, unallocatable
from allreduce.gpus import nccl_sharing_problem, shared_gpu
from conftest import mpirun

GiB = 1 << 30


@pytest.mark.parametrize("gpus, visible, shared", [
    (1, [None] * 2, ("0", [0, 1], 1)),
    (2, [None] * 4, ("0", [0, 2], 2)),
    (2, [None] * 2, None),
    (1, ["0", "1", "2"], None),                 # a GPU bound to each rank (Slurm, say)
    (1, ["0", "0"], ("0", [0, 1], 1)),
    (2, ["0,1", "1,0"], ("0", [0, 1], 1)),      # rank i takes the i-th of those it sees
    (2, ["GPU-a", "GPU-b", None], None),        # names as CUDA_VISIBLE_DEVICES has them
    (1, ["", ""], None),                        # ranks that see no GPU share none
])
def test_the_gpu_two_ranks_of_a_host_would_share(gpus, visible, shared):
    assert shared_gpu(gpus, visible) == shared


def test_the_sharing_problem_names_the_host_the_ranks_and_the_gpu():
    assert nccl_sharing_problem("h0", 2, [None] * 2) is None
    assert nccl_sharing_problem("h0", 1, [None] * 3) == (
        "3 ranks on host h0 but 1 GPU for them (local ranks 0, 1, 2 would share GPU 0); "
        "NCCL needs a GPU per rank")


PROBLEM = "2 ranks on host h0 but 1 GPU for them (local ranks 0, 1 would share GPU 0)"


def test_the_nccl_row_the_benchmark_added_is_left_out_with_a_note():
    args = parse_args(["--device", "cuda", "--algos", "ring,mpi"])
    assert args.algos == ["ring", "mpi", "torch"] and args.nccl_added
    rows, note = nccl_rows(args.algos, args.transport, args.nccl_added, PROBLEM)
    assert rows == ["ring", "mpi"]
    assert note == f"# no torch (NCCL) row: {PROBLEM}" and "\n" not in note
    assert nccl_rows(args.algos, args.transport, args.nccl_added, None) == (args.algos, None)


@pytest.mark.parametrize("flags, named", [
    (["--algos", "ring,torch"], "torch over NCCL"),              # asked for
    (["--algos", "ring", "--transport", "torch"], "ring over NCCL"),   # torch: added
])
def test_nccl_rows_asked_for_are_refused_naming_them(flags, named):
    args = parse_args(["--device", "cuda"] + flags)
    expected = re.escape(f"--device cuda: {named} cannot run: {PROBLEM}")
    with pytest.raises(ValueError, match=expected):
        nccl_rows(args.algos, args.transport, args.nccl_added, PROBLEM)


def test_no_nccl_row_no_question():
    cpu = parse_args(["--algos", "ring,mpi"])
    assert not cpu.nccl_added and nccl_rows(cpu.algos, "mpi", False, PROBLEM) == (cpu.algos, None)
    emulated = parse_args(["--device", "cuda", "--algos", "ring", "--link-gbps", "1"])
    assert emulated.algos == ["ring"]
    assert nccl_rows(emulated.algos, "mpi", emulated.nccl_added, PROBLEM) == (["ring"], None)


def test_the_memory_a_size_needs_grows_with_rows_ranks_and_size():
    host, device = memory_needed(1 << 20, "float32", 2, 3)
    assert device == 0 and host == (1 << 20) * 8 + 8 * (1 << 18) * 7
    assert memory_needed(2 << 20, "float32", 2, 3)[0] == 2 * host
    assert memory_needed(1 << 20, "float32", 4, 3)[0] > host
    on_host, on_gpu = memory_needed(1 << 20, "float32", 2, 3, device="cuda")
    assert on_gpu == (1 << 20) * 8 and on_host < host


def test_a_size_that_cannot_be_allocated_is_named_in_one_line():
    message = unallocatable([4096, 1 << 40], "float32", 2, 3, host_free=8 * GiB)
    assert message.startswith("size 1T needs about ") and "GiB of host memory per rank" in message
    assert "8.0 GiB is available to each" in message and "\n" not in message
    assert unallocatable([4096, 64 << 20], "float32", 2, 3, host_free=8 * GiB) is None
    assert unallocatable([1 << 40], "float32", 2, 3, host_free=None) is None    # unknown: try
    on_gpu = unallocatable([4 * GiB], "float32", 2, 3, 1 << 50, "cuda", device_free=GiB)
    assert "of GPU memory" in on_gpu and "1.0 GiB is available" in on_gpu


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_bench_refuses_a_size_larger_than_memory_before_allocating():
    result = mpirun(2, ["-m", "allreduce.bench", "--sizes", "4K,1T", "--iters", "1"], timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [ln for ln in result.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith("allreduce.bench rank 0: error: size 1T ")
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr
    assert "algbw" not in result.stdout                   # no header: nothing ran
