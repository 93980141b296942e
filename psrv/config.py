"""What a worker tells the servers at initialisation: optimizer and consistency model;
and the checks of a server's own options (check_server_options).

Both are frozen dataclasses validated on construction, and both travel in the
INIT message as one fixed `struct` (CONFIG below), never pickled:

    CONFIG  <B d d d d d d B I I  (59 bytes)
            optimizer code, lr, momentum, beta1, beta2, eps, weight_decay,
            consistency code, staleness bound, number of workers

Consistency models (Ho et al. 2013, "More effective distributed ML via a stale
synchronous parallel parameter server"):

    bsp  a key's update for step t is applied once all W workers pushed t
         (their gradients averaged), and a pull at clock t+1 waits for it
    ssp  each push is applied on arrival (scaled by 1/W); a worker at clock t
         waits until the slowest worker has reached clock t - s
    asp  each push is applied on arrival (scaled by 1/W); nobody waits
"""
import math
import struct
from dataclasses import dataclass

OPTIMIZERS = ("sgd", "adam")      # the order is the wire code: sgd=0, adam=1
MODES = ("bsp", "ssp", "asp")      # bsp=0, ssp=1, asp=2

CONFIG = struct.Struct("<BddddddBII")


@dataclass(frozen=True)
class OptimizerConfig:
    """torch.optim.SGD / torch.optim.Adam hyper-parameters (dampening 0, no nesterov, no amsgrad)."""
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer name {self.name!r} is not one of {OPTIMIZERS}")
        if not 0 < self.lr < math.inf:        # also false for NaN
            raise ValueError(f"lr must be finite and > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        if not (0 < self.eps < math.inf and 0 <= self.weight_decay < math.inf):
            raise ValueError(f"need finite eps > 0 and weight_decay >= 0, got eps {self.eps}, "
                             f"weight_decay {self.weight_decay}")
        object.__setattr__(self, "betas", (float(b1), float(b2)))


@dataclass(frozen=True)
class Consistency:
    mode: str = "bsp"
    staleness: int = 0            # the bound s of ssp; ignored by bsp and asp

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"consistency mode {self.mode!r} is not one of {MODES}")
        if not 0 <= self.staleness < 2**31:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")


def pack_config(opt, consistency, num_workers):
    return CONFIG.pack(OPTIMIZERS.index(opt.name), opt.lr, opt.momentum, opt.betas[0],
                       opt.betas[1], opt.eps, opt.weight_decay,
                       MODES.index(consistency.mode), consistency.staleness, num_workers)


def unpack_config(buf):
    """bytes -> (OptimizerConfig, Consistency, num_workers); ValueError names the bad field."""
    if len(buf) != CONFIG.size:
        raise ValueError(f"config frame is {len(buf)} bytes, expected {CONFIG.size}")
    code, lr, mom, b1, b2, eps, wd, mode, s, w = CONFIG.unpack(buf)
    if code >= len(OPTIMIZERS) or mode >= len(MODES):
        raise ValueError(f"unknown optimizer code {code} or consistency code {mode}")
    opt = OptimizerConfig(OPTIMIZERS[code], lr, mom, (b1, b2), eps, wd)
    return opt, Consistency(MODES[mode], s), w


def check_server_options(shard, num_shards, worker_timeout, join_timeout, on_worker_death,
                         checkpoint_every, max_unread, on_signal="checkpoint",
                         step_messages=None):
    """A server's own options (server.Server): ValueError naming the first bad one,
    before the server does anything."""
    if on_worker_death not in ("fail", "continue"):
        raise ValueError(f"on_worker_death must be 'fail' or 'continue', got {on_worker_death!r}")
    if on_signal not in ("checkpoint", "drain"):
        raise ValueError(f"on_signal must be 'checkpoint' or 'drain', got {on_signal!r}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} not in [0, num_shards={num_shards})")
    for name, value in (("worker_timeout", worker_timeout), ("join_timeout", join_timeout)):
        if not 0 < value < math.inf:      # also false for NaN
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0 steps, got {checkpoint_every}")
    if max_unread is not None and not 0 < max_unread < math.inf:
        raise ValueError(f"max_unread must be a finite number of bytes > 0, got {max_unread}")
    if step_messages is not None and (not isinstance(step_messages, int)
                                      or step_messages < 1):
        raise ValueError(f"step_messages must be a whole number of messages >= 1, "
                         f"got {step_messages!r}")
