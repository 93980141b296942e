"""Which positions of a sequence each cp rank holds (--cp-order): contiguous or zig-zag.

    T = 8, cp = 2          positions  0 1 2 3 4 5 6 7
    contiguous  cp chunks             0 0 0 0 1 1 1 1     rank r: chunk r
    zigzag    2 cp chunks             0 0 1 1 1 1 0 0     rank r: chunks r and 2 cp - 1 - r

Contiguous is the plain split: rank r holds [r t, (r+1) t), t = T / cp.  Under causal
masking it is unbalanced: rank r's queries see the keys of chunks 0 .. r, so the last
rank attends over all T positions and the first over its own t, and the ring runs at
the last rank's pace (ring_attention.py's table).  The zig-zag order pairs an early
chunk with its mirror image from the end, so every rank's queries see the same number
of keys: rank r computes (r + 1) + (2 cp - r) = 2 cp + 1 chunk pairs of (T / 2 cp)^2
scores, whatever r.  It is the order of Llama 3's context parallelism (Llama Team,
"The Llama 3 Herd of Models", 2024, section 3.3.2) and of ring-flash-attention's
zigzag ring; Brandon et al., "Striped Attention" (2023), balances the same work by
giving rank r every cp-th position instead.

A rank holds its chunks side by side, in increasing order (r, then 2 cp - 1 - r):
everything that works on each position alone (embeddings, LayerNorms, the MLP, the
loss) runs on them unchanged; the position embedding looks up their true positions
(`positions_of`), and attention compares true positions (ring_attention.py by chunk,
ulysses.py by putting the gathered sequence back in order).
"""
import torch

CONTIGUOUS, ZIGZAG = "contiguous", "zigzag"


def chunks_of(cp_rank, cp_size, order):
    """(the chunks cp rank holds, in its order; how many chunks a sequence is cut into)."""
    if order == ZIGZAG:
        return [cp_rank, 2 * cp_size - 1 - cp_rank], 2 * cp_size
    return [cp_rank], cp_size


def positions_of(cp_rank, cp_size, seq_len, order, device=None):
    """The global positions of the tokens cp rank holds, in its order: (seq_len / cp,)."""
    chunks, n = chunks_of(cp_rank, cp_size, order)
    c = seq_len // n
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks])


def gathered_positions(cp_size, seq_len, order, device=None):
    """The global position at each index of the cp ranks' tokens laid end to end, rank 0's
    first (what an all-gather over the cp axis holds): (seq_len,)."""
    return torch.cat([positions_of(r, cp_size, seq_len, order, device)
                      for r in range(cp_size)])
