"""What --recompute buys and costs: saved-activation bytes and step time, measured.

    .venv/bin/python -m experiments.recompute_memory                  # the table of
    .venv/bin/python -m experiments.recompute_memory --layers 2,4,8   # docs/training.md

One process, no communication: for each GPT depth, the same model and batch with
and without strategies.parallel.recompute, the peak bytes autograd saves for backward over
one forward (memory.ActivationMeter, through recompute.saved_activation_bytes) and
the median time of a forward + backward.  Without recompute the saved bytes grow
with the blocks' insides, with it with the blocks' inputs (B x T x d floats each);
the time grows by one more forward of every block (Chen et al. 2016: about 1/3).
Several hosts: nothing to gain, it is per process.
"""
import argparse
import statistics
import time

import torch

from strategies.model.models import GPT
from strategies.parallel.recompute import Recompute, saved_activation_bytes


def measure(layers, d_model, seq_len, batch, heads, vocab, repeats):
    """(saved bytes, median forward + backward seconds) without and with recompute."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch, seq_len), generator=g)
    y = torch.randint(0, vocab, (batch, seq_len), generator=g)
    out = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(vocab, seq_len, layers, d_model, heads)
        rc = Recompute(model) if recompute else None
        saved = saved_activation_bytes(model, x, y)
        times = []
        for _ in range(repeats):
            model.zero_grad()
            start = time.perf_counter()
            loss = model.criterion(model(x), y)
            with rc.backward() if rc else torch.enable_grad():
                loss.backward()
            times.append(time.perf_counter() - start)
        out.append((saved, statistics.median(times)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.recompute_memory",
                                description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="2,4,8", help="GPT depths, comma-separated")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    print(f"gpt d_model {a.d_model}, seq_len {a.seq_len}, batch {a.batch}, heads {a.heads}; "
          f"block input {a.batch * a.seq_len * a.d_model * 4 / 2**20:.2f} MiB; "
          f"{torch.get_num_threads()} torch thread(s)")
    print(f"{'layers':>6} {'saved MiB':>10} {'recompute':>10} {'ratio':>6} "
          f"{'step ms':>8} {'recompute':>10} {'slower':>7}")
    for layers in map(int, a.layers.split(",")):
        (plain, t_plain), (kept, t_kept) = measure(layers, a.d_model, a.seq_len, a.batch,
                                                   a.heads, a.vocab, a.repeats)
        print(f"{layers:>6} {plain / 2**20:>10.2f} {kept / 2**20:>10.2f} {plain / kept:>6.1f} "
              f"{t_plain * 1e3:>8.1f} {t_kept * 1e3:>10.1f} {t_kept / t_plain - 1:>+7.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
