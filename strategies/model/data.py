"""Data sets with learnable structure, and the deterministic split of a global batch.

    data = load_data(cfg)                            # synthetic, or cfg.data (.npz / text)
    x, y = data.batch(step, dp_rank, dp_size, B)     # this rank's part of step's global batch

Synthetic sets (so that the loss really falls):
  * mlp: inputs x ~ N(0, 1); labels y = argmax of a fixed random teacher
    network (in_dim -> 64 tanh -> classes).  The student can learn the teacher.
  * gpt: token sequences from a fixed random Markov chain whose rows are drawn
    from a Dirichlet(0.2), so each token has a few likely successors: the
    best achievable loss is the chain's entropy rate, well below ln(vocab).

User data:
  * mlp: an .npz with `x` (N, features), any real dtype, and `y`: (N,) integer
    class labels (cross-entropy) or (N, outputs) reals (mean squared error).
  * gpt: any file read as bytes; vocabulary 256, samples are consecutive
    windows of seq_len + 1 bytes (input = the first seq_len, target = shifted by one).

The global batch of step s: samples are visited in a random permutation per
epoch, seeded by (seed, epoch), so step s takes positions s*B .. s*B+B-1 of
that sequence of epochs, whatever the world size.  DP rank r keeps the part
`shard_bounds(B, dp)[r]`: P ranks together see exactly the batch one process sees.
"""
import os
from dataclasses import dataclass

import numpy as np
import torch

from allreduce import shard_bounds

from ..config.choices import ConfigError


@dataclass(frozen=True)
class DataSpec:
    task: str          # classify, regress or lm
    in_dim: int = 0
    out_dim: int = 0
    vocab: int = 0


class Dataset:
    def __init__(self, x, y, spec, seed, name):
        self.x, self.y, self.spec, self.seed, self.name = x, y, spec, seed, name
        self._epoch, self._order = None, None

    def order(self, epoch):
        """The visiting order of an epoch (the last one is kept: big files, many steps)."""
        if self._epoch != epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, 1, epoch]).permutation(len(self))
        return self._order

    def __len__(self):
        return len(self.x)

    def global_indices(self, step, batch):
        """Sample indices of step's global batch (epochs of seeded permutations)."""
        n = len(self)
        first = step * batch
        out = []
        while len(out) < batch:
            epoch, offset = divmod(first + len(out), n)
            out.extend(self.order(epoch)[offset:offset + batch - len(out)].tolist())
        return np.asarray(out, dtype=np.int64)

    def batch(self, step, dp_rank, dp_size, global_batch, device="cpu"):
        idx = self.global_indices(step, global_batch)
        start, stop = shard_bounds(global_batch, dp_size)[dp_rank]
        part = torch.from_numpy(idx[start:stop])
        return self.x[part].to(device), self.y[part].to(device)


def teacher_data(cfg):
    rng = np.random.default_rng([cfg.seed, 2])
    x = rng.standard_normal((cfg.dataset_size, cfg.in_dim)).astype(np.float32)
    w1 = rng.standard_normal((cfg.in_dim, 64)) / np.sqrt(cfg.in_dim)
    w2 = rng.standard_normal((64, cfg.classes)) / np.sqrt(64)
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1)
    spec = DataSpec("classify", cfg.in_dim, cfg.classes)
    return Dataset(torch.from_numpy(x), torch.from_numpy(y), spec, cfg.seed, "teacher")


def markov_data(cfg):
    rng = np.random.default_rng([cfg.seed, 3])
    V, N, L = cfg.vocab, cfg.dataset_size, cfg.seq_len + 1
    cumulative = np.cumsum(rng.dirichlet(np.full(V, 0.2), size=V), axis=1)
    seq = np.empty((N, L), dtype=np.int64)
    seq[:, 0] = rng.integers(0, V, N)
    for t in range(1, L):
        # inverse-CDF sampling of every sequence's next token at once
        u = rng.random((N, 1))
        seq[:, t] = np.minimum((cumulative[seq[:, t - 1]] < u).sum(axis=1), V - 1)
    seq = torch.from_numpy(seq)
    return Dataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous(),
                   DataSpec("lm", vocab=V), cfg.seed, "markov")


def npz_data(cfg):
    path = cfg.data
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:  # zip, pickle and format errors all mean: not our .npz
        raise ConfigError(f"--data {path}: cannot read it as an .npz file ({e})",
                          field="data") from None
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise ConfigError(f"--data {path}: needs arrays 'x' and 'y', missing "
                          f"{', '.join(missing)} (found {', '.join(arrays) or 'none'})",
                          field="data")
    x, y = arrays["x"], arrays["y"]
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
        raise ConfigError(f"--data {path}: x must be a 2-D real array (samples, features), "
                          f"got shape {x.shape} dtype {x.dtype}", field="data")
    if len(y) != len(x):
        raise ConfigError(f"--data {path}: x has {len(x)} samples but y has {len(y)}",
                          field="data")
    if y.ndim == 1 and np.issubdtype(y.dtype, np.integer):
        if y.min() < 0:
            raise ConfigError(f"--data {path}: class labels must be >= 0, found {y.min()}",
                              field="data")
        spec = DataSpec("classify", x.shape[1], int(y.max()) + 1)
        y = torch.from_numpy(y.astype(np.int64))
    elif y.ndim == 2 and np.issubdtype(y.dtype, np.floating):
        spec = DataSpec("regress", x.shape[1], y.shape[1])
        y = torch.from_numpy(y.astype(np.float32))
    else:
        raise ConfigError(f"--data {path}: y must be (N,) integer labels or (N, outputs) "
                          f"floats, got shape {y.shape} dtype {y.dtype}", field="data")
    return Dataset(torch.from_numpy(x.astype(np.float32)), y, spec, cfg.seed, path)


def text_data(cfg):
    path = cfg.data
    if path.endswith(".npz"):
        raise ConfigError(f"--data {path}: --model gpt reads plain text, not .npz arrays",
                          field="data")
    with open(path, "rb") as f:
        raw = np.frombuffer(f.read(), dtype=np.uint8)
    L = cfg.seq_len + 1
    if len(raw) < L:
        raise ConfigError(f"--data {path}: {len(raw)} bytes is shorter than one sample "
                          f"(--seq-len {cfg.seq_len} + 1)", field="data")
    seq = torch.from_numpy(raw[:len(raw) // L * L].astype(np.int64).reshape(-1, L))
    return Dataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous(),
                   DataSpec("lm", vocab=256), cfg.seed, path)


def load_data(cfg):
    """The data set of cfg, or ConfigError naming what is wrong with the file."""
    if not cfg.data:
        return teacher_data(cfg) if cfg.model == "mlp" else markov_data(cfg)
    if not os.path.isfile(cfg.data):
        raise ConfigError(f"--data {cfg.data}: no such file", field="data")
    return npz_data(cfg) if cfg.model == "mlp" else text_data(cfg)
