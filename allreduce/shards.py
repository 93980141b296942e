"""Which part of a flat buffer belongs to which rank.

This is the one place that decides shard boundaries. Reduce-scatter returns
shard `r` to rank `r`, all-gather concatenates the shards in rank order, and
ZeRO shards parameters, gradients and optimizer state with the same function,
so the three always agree.

The rule is numpy's `array_split`: n elements over P ranks, the first n % P
ranks get one element more than the others.

    n = 10, P = 4   ->   [0:3) [3:6) [6:8) [8:10)      sizes 3 3 2 2
    n = 2,  P = 4   ->   [0:1) [1:2) [2:2) [2:2)      sizes 1 1 0 0
"""


def shard_bounds(n, parts):
    """The [start, stop) of every part of `n` elements split into `parts`."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    if n < 0:
        raise ValueError(f"cannot split a negative length {n}")
    base, extra = divmod(n, parts)
    bounds = []
    start = 0
    for part in range(parts):
        stop = start + base + (1 if part < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_of(rank, n, parts):
    """The [start, stop) of rank `rank`'s shard of `n` elements."""
    return shard_bounds(n, parts)[rank]


def bounds_from_sizes(sizes):
    """[start, stop) of consecutive pieces of the given sizes (all-gather of uneven shards)."""
    bounds = []
    start = 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def span(bounds, first, last):
    """The [start, stop) covering pieces first..last-1, which must be consecutive."""
    return bounds[first][0], bounds[last - 1][1]
