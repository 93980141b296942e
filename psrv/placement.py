"""Which server owns which bytes: keys (parameter names) -> slices -> servers.

A parameter larger than `slice_bytes` is cut into nearly equal slices, as BytePS
partitions tensors (Jiang et al., OSDI 2020), and into a multiple of S slices, so
that every server's link carries an equal share of it; the slices of one message
also pipeline (a server updates slice 1 while slice 2 is on the wire).  Slices
are dealt out largest first, each to the server holding the fewest bytes so far
(Graham's LPT rule); with every slice at most slice_bytes the loads differ by at
most one slice.

    print(Placement({"w": (1000, 1000), "b": (1000,)}, num_servers=2, slice_bytes=1 << 20))
    # b is key 0 (4000 bytes); w is keys 1-4 (1 MB each), two slices of w per server

Key ids number the slices in sorted-name order, so every worker that builds a
Placement from the same names and shapes gets the same ids and owners.
"""
import math
from dataclasses import dataclass

DEFAULT_SLICE_BYTES = 4 << 20


@dataclass(frozen=True)
class Slice:
    key: int
    name: str
    offset: int          # in elements of the flattened parameter
    length: int
    shape: tuple         # the whole parameter's shape
    server: int


class Placement:
    def __init__(self, shapes, num_servers, slice_bytes=DEFAULT_SLICE_BYTES, itemsize=4):
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        if slice_bytes < itemsize:
            raise ValueError(f"slice_bytes {slice_bytes} < itemsize {itemsize}")
        self.num_servers = num_servers
        self.itemsize = itemsize
        # 1. cut: slice i of n covers [i*q + min(i, r), ...) as np.array_split does
        pieces = []
        for name in sorted(shapes):
            shape = tuple(int(d) for d in shapes[name])
            numel = math.prod(shape)
            n = math.ceil(numel * itemsize / slice_bytes)
            if n > 1:        # a multiple of S, so that every server gets an equal share
                n = math.ceil(n / num_servers) * num_servers
            n = max(1, n)
            q, r = divmod(numel, n)
            for i in range(n):
                pieces.append((name, i * q + min(i, r), q + (i < r), shape))
        # 2. deal: largest first, to the least-loaded server (ties: lower key, lower server)
        self.server_bytes = [0] * num_servers
        owner = {}
        for key in sorted(range(len(pieces)), key=lambda k: (-pieces[k][2], k)):
            s = min(range(num_servers), key=lambda s: (self.server_bytes[s], s))
            owner[key] = s
            self.server_bytes[s] += pieces[key][2] * itemsize
        self.slices = [Slice(k, *pieces[k], owner[k]) for k in range(len(pieces))]
        self.by_name = {}
        for sl in self.slices:
            self.by_name.setdefault(sl.name, []).append(sl)

    def on_server(self, server):
        return [sl for sl in self.slices if sl.server == server]

    def imbalance(self):
        """max / mean bytes per server (1.0 is perfect)."""
        mean = sum(self.server_bytes) / self.num_servers
        return max(self.server_bytes) / mean if mean else 1.0

    def __str__(self):
        rows = [f"{'key':>5}  {'name':<24} {'offset':>10} {'length':>10} {'server':>6}"]
        rows += [f"{s.key:5d}  {s.name:<24} {s.offset:10d} {s.length:10d} {s.server:6d}"
                 for s in self.slices]
        rows.append("bytes per server: " + ", ".join(f"{b}" for b in self.server_bytes)
                    + f"  (max/mean {self.imbalance():.3f})")
        return "\n".join(rows)
