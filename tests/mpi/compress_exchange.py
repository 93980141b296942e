"""Top-k's all-gather and PowerSGD's factor all-reduces against a reference every rank computes.

    mpiexec -n 2 python -m mpi4py tests/mpi/compress_exchange.py
    mpiexec -n 3 python -m mpi4py tests/mpi/compress_exchange.py

Every rank's gradient is a known function of its rank, so each rank can compute
what every other rank sends and check the exchanged result on its own
(tests/test_compress.py states the tolerance).  The inputs are rank- and
position-dependent with overlapping top-k picks, never all-ones.
"""
import sys

import torch

import allreduce
from strategies.compression.powersgd import PowerSGDCompressor
from strategies.config.compress_spec import topk_count
from strategies.compression.topk import TopKCompressor, select_topk

RTOL, ATOL = 1e-6, 1e-6
N, RATIO = 101, 0.1                       # an awkward length: k = 11


def grad_of(rank, step):
    """Rank r's gradient at a step: large entries partly shared with the other ranks."""
    x = torch.arange(N, dtype=torch.float32)
    return torch.sin(x * (rank + 1) + step) * (1 + (x % 7 == rank)) + 0.01 * rank


def main():
    coll = allreduce.create(sys.argv[1] if len(sys.argv) > 1 else "ring", timeout=60)
    rank, size = coll.rank, coll.size
    # top-k with error feedback, three steps: each rank replays every rank's residuals
    topk = TopKCompressor(RATIO, coll)
    residuals = [torch.zeros(N) for _ in range(size)]
    for step in range(3):
        flat = grad_of(rank, step)
        handed = topk.reduce_bucket(0, flat, None, [(N,)], None)
        expected = torch.zeros(N)
        for r in range(size):
            acc = grad_of(r, step) + residuals[r]
            indices, values = select_topk(acc, topk_count(N, RATIO))
            expected.index_add_(0, indices, values)
            acc[indices] = 0
            residuals[r] = acc
        torch.testing.assert_close(flat, expected / size, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(topk.feedback.residual(0), residuals[rank], rtol=0, atol=0)
        assert handed == 2 * topk_count(N, RATIO) * 4, handed
    # PowerSGD: the ranks end with the same update, the mean of what each rank sent
    shapes = [(12, 9), (9,), (5, 2)]
    n = sum(torch.Size(s).numel() for s in shapes)
    power = PowerSGDCompressor(2)
    average = lambda t: coll.allreduce(t, op="avg")            # noqa: E731
    flat = torch.randn(n, generator=torch.Generator().manual_seed(rank + 7))
    acc = flat.clone()
    power.reduce_bucket(0, flat, None, shapes, average)
    sent = acc - power.feedback.residual(0)
    mean_sent = sent.clone()
    coll.allreduce(mean_sent, op="avg")
    torch.testing.assert_close(flat, mean_sent, rtol=1e-5, atol=1e-6)
    gathered = coll.allgather(flat)
    for r in range(size):
        torch.testing.assert_close(torch.as_tensor(gathered[r * n:(r + 1) * n]), flat,
                                   rtol=0, atol=0)
    if rank == 0:
        print(f"compress exchange OK on {size} ranks", flush=True)


if __name__ == "__main__":
    main()
