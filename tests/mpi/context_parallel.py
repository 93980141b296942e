"""Ring attention and Ulysses against whole-sequence attention in one process.

    mpiexec -n 2 python -m mpi4py tests/mpi/context_parallel.py

Every rank draws the whole batch from one seed, computes the reference on the
gathered sequence itself (torch's scaled_dot_product_attention, forward and the
gradients of q, k, v), then its own shard through the cp ranks, and compares its
positions, in both --cp-order layouts.  Seven positions a rank in the contiguous
order, ten in the zig-zag one (two chunks of five): awkward lengths, no power of
two, diagonal blocks of odd size; values of order 1, so rtol = atol (tolerances in
tests/test_context_parallel.py).  Bytes: what each core counted, and what the
transport counted, must equal the formulas exactly.  Last, a whole GPT block with
the core swapped in: its output and, summed over the cp ranks, its parameters'
gradients equal the unsplit block's.
"""
import copy
import sys

import torch
import torch.nn.functional as F

import allreduce
from strategies.model.models import Block
from strategies.parallel.context_order import positions_of
from strategies.parallel.ring_attention import RingAttention, ring_bytes
from strategies.parallel.ulysses import Ulysses, ulysses_bytes

B, HEADS, D = 2, 6, 2                     # 6 heads: cp 2 and 3 divide them
T_RANK = {"contiguous": 7, "zigzag": 10}  # positions a rank: zigzag's two chunks of 5
C = HEADS * D
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}


def reference(q, k, v, causal):
    """Attention of whole sequences: (B, T, C) -> (B, T, C)."""
    Bq, T, _ = q.shape
    q, k, v = (x.view(Bq, T, HEADS, D).transpose(1, 2) for x in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return y.transpose(1, 2).reshape(Bq, T, C)


def check_core(core, rank, cp, dtype, causal, bytes_formula, transport, order):
    tol = TOLERANCE[dtype]
    T = cp * T_RANK[order]
    g = torch.Generator().manual_seed(7)
    q, k, v, w = (torch.randn(B, T, C, generator=g, dtype=dtype) for _ in range(4))
    mine = positions_of(rank, cp, T, order)
    # the reference, whole
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    y_ref = reference(*whole, causal)
    (y_ref * w).sum().backward()
    # this rank's shard through the cp ranks
    shard = [x[:, mine].clone().requires_grad_() for x in (q, k, v)]
    sent_before = transport.bytes_sent
    y = core(*shard, HEADS)
    (y * w[:, mine]).sum().backward()
    torch.testing.assert_close(y, y_ref[:, mine].detach(), rtol=tol, atol=tol)
    for name, got, want in zip("qkv", shard, whole):
        torch.testing.assert_close(got.grad, want.grad[:, mine], rtol=tol, atol=tol,
                                   msg=lambda m: f"d{name} on rank {rank}: {m}")
    itemsize = torch.finfo(dtype).bits // 8
    expected = bytes_formula(B, T, C, cp, itemsize)
    assert transport.bytes_sent - sent_before == expected, (transport.bytes_sent - sent_before,
                                                           expected)
    return expected


def check_block(core, coll, rank, cp):
    """A GPT block with `core` in place of its attention, on this rank's positions."""
    t = T_RANK["contiguous"]
    T = cp * t
    torch.manual_seed(3)
    whole = Block(C, HEADS).double()
    split = copy.deepcopy(whole)
    split.attn.core = core
    x = torch.randn(B, T, C, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mine = slice(rank * t, (rank + 1) * t)
    y_ref = whole(x)
    (y_ref ** 2).sum().backward()
    y = split(x[:, mine])
    (y ** 2).sum().backward()
    torch.testing.assert_close(y, y_ref[:, mine].detach(), rtol=1e-10, atol=1e-10)
    # each rank's gradient covers its own positions: their sum over cp is the whole's
    for (name, p), p_ref in zip(split.named_parameters(), whole.parameters()):
        total = coll.allreduce(p.grad.clone())
        torch.testing.assert_close(total, p_ref.grad, rtol=1e-10, atol=1e-10, msg=name)


def main():
    coll = allreduce.create(sys.argv[1] if len(sys.argv) > 1 else "ring", timeout=60)
    rank, cp = coll.rank, coll.size
    transport = coll.transport
    counted = {}
    for order in ("contiguous", "zigzag"):
        for dtype in (torch.float64, torch.float32):
            for causal in (True, False):
                ring = RingAttention(transport, causal=causal, order=order)
                counted["ring", order, dtype, causal] = check_core(
                    ring, rank, cp, dtype, causal, ring_bytes, transport, order)
                assert ring.bytes_sent == counted["ring", order, dtype, causal]
            ulysses = Ulysses(coll, order=order)
            counted["ulysses", order, dtype] = check_core(
                ulysses, rank, cp, dtype, True, ulysses_bytes, transport, order)
            assert ulysses.bytes_sent == counted["ulysses", order, dtype]
    check_block(RingAttention(transport), coll, rank, cp)
    check_block(Ulysses(coll), coll, rank, cp)
    if rank == 0:
        block = B * T_RANK["contiguous"] * C * 8
        ring = counted["ring", "contiguous", torch.float64, True]
        print(f"ring float64 bytes a layer {ring} = {ring // block} blocks of {block}")
        print(f"ulysses float64 bytes a layer "
              f"{counted['ulysses', 'contiguous', torch.float64]}")
        print(f"context parallel OK on {cp} ranks")


if __name__ == "__main__":
    main()
