"""A model of your own, trained data parallel with strategies.DistributedOptimizer.

A small CNN learns which of four patterns (a horizontal bar, a vertical bar, a
diagonal, a dot) hides in a noisy 8 x 8 image.  Everything in it is the
user's: the model, the data, the loop.  The lines marked `# distributed` are
the whole difference from a one-process script.

One process:
    .venv/bin/python -m strategies.example_user_model
Two processes on this host (any --sync: ring, tree, halving_doubling,
hierarchical, mpi, torch, auto):
    .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.example_user_model --sync ring
Parameter servers (ranks 0 and 1 train, rank 2 serves):
    .venv/bin/mpiexec -n 3 .venv/bin/python -m mpi4py -m strategies.example_user_model \\
        --sync ps --servers 1
torchrun, without MPI:
    .venv/bin/torchrun --standalone --nproc-per-node 2 -m strategies.example_user_model \\
        --sync torch
Several hosts (a hostfile; ranks fill hosts in blocks):
    mpiexec -f hosts.txt -n 8 -ppn 4 /path/.venv/bin/python -m mpi4py \\
        -m strategies.example_user_model --sync hierarchical
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import strategies                                          # distributed


class PatternNet(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.norm(self.features(x)))


def patterns():
    p = torch.zeros(4, 8, 8)
    p[0, 3:5, 1:7] = 1                       # horizontal bar
    p[1, 1:7, 3:5] = 1                       # vertical bar
    p[2] = torch.eye(8)                      # diagonal
    p[3, 3:5, 3:5] = 1                       # dot
    return p


def make_batch(seed, size):
    """The same images on every rank for the same seed: each rank then takes its shard."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (size,), generator=g)
    x = patterns()[y] + 0.5 * torch.randn(size, 8, 8, generator=g)
    return x.unsqueeze(1), y


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m strategies.example_user_model")
    p.add_argument("--sync", default="ring")
    p.add_argument("--servers", type=int, default=1, help="ps / hybrid: serving ranks")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--compress", default="none")
    p.add_argument("--no-overlap", dest="overlap", action="store_false")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    role = None
    if args.sync in ("ps", "hybrid"):                      # distributed: psrv decides who
        role = strategies.ps_roles(servers=args.servers)   # distributed: serves
        if role.is_server:                                 # distributed
            role.serve()                                   # distributed: until workers close
            return 0

    torch.manual_seed(0)       # one init everywhere (without it rank 0's would win anyway)
    model = PatternNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = strategies.DistributedOptimizer(                 # distributed
        optimizer, model, sync=args.sync, role=role, bucket_mb=args.bucket_mb,
        compress=args.compress, overlap=args.overlap)
    if args.global_batch % opt.size:                       # distributed
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by "
                         f"{opt.size} ranks")
    per_rank = args.global_batch // opt.size               # distributed
    mine = slice(opt.rank * per_rank, (opt.rank + 1) * per_rank)   # distributed
    with opt:                                              # closes the sync at the end
        for step in range(args.steps):
            x, y = make_batch(step, args.global_batch)
            opt.zero_grad()
            loss = F.cross_entropy(model(x[mine]), y[mine])   # mean over this rank's shard
            loss.backward()
            opt.step()
            if opt.rank == 0 and (step % 20 == 0 or step == args.steps - 1):
                print(f"step {step:3d}  loss {loss.item():.4f} (rank 0's shard)", flush=True)
    if opt.rank == 0:
        x, y = make_batch(10**6, 512)                      # images no step has seen
        with torch.no_grad():
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        print(f"[{args.sync}] {opt.size} {'workers' if role else 'ranks'}, global batch "
              f"{args.global_batch}: held-out accuracy {accuracy:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
