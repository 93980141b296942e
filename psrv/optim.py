"""The optimizer a server applies to its slices: torch.optim.SGD and Adam, in float32 numpy.

The formulas are torch's single-tensor CPU code (torch/optim/sgd.py, adam.py), so
that a BSP run through the servers reproduces an all-reduce run with torch's
optimizer up to float rounding (torch fuses `a + alpha*b` into one FMA; numpy
rounds twice):

    SGD, momentum m, weight decay wd:        Adam (Kingma & Ba 2015, Algorithm 1):
      d   = g + wd * p                         g   = g + wd * p
      buf = d             at the first step    m   = m + (1 - b1) * (g - m)      (lerp)
      buf = m * buf + d   afterwards           v   = b2 * v + (1 - b2) * g * g
      p   = p - lr * buf                       den = sqrt(v) / sqrt(1 - b2^t) + eps
                                               p   = p - lr / (1 - b1^t) * m / den

Every function works on views of one chunk (param[a:b], the gradient frame,
state[a:b]), so an update runs chunk by chunk as frames arrive, without
allocating a whole-tensor temporary.  State arrays are created zeroed by
`new_state`; `t` is the 1-based count of updates applied to this key.
"""
import numpy as np


def new_state(opt, n):
    """Optimizer state for a key of n elements: a dict of float32 arrays."""
    if opt.name == "adam":
        return {"exp_avg": np.zeros(n, np.float32), "exp_avg_sq": np.zeros(n, np.float32)}
    if opt.momentum:
        return {"momentum_buffer": np.zeros(n, np.float32)}
    return {}


def apply(opt, t, param, grad, state):
    """Update param (a float32 view) in place with grad; state holds views of the same range."""
    if opt.weight_decay:
        grad = grad + np.float32(opt.weight_decay) * param
    if opt.name == "sgd":
        _sgd(opt, t, param, grad, state)
    else:
        _adam(opt, t, param, grad, state)


def _sgd(opt, t, param, grad, state):
    if opt.momentum:
        buf = state["momentum_buffer"]
        if t == 1:
            np.copyto(buf, grad)
        else:
            buf *= np.float32(opt.momentum)
            buf += grad
        grad = buf
    step = _scratch(len(param))      # no temporary per call: the update runs at memory speed
    np.multiply(grad, np.float32(opt.lr), out=step)
    param -= step


_SCRATCH = [np.empty(0, np.float32)]


def _scratch(n):
    if len(_SCRATCH[0]) < n:
        _SCRATCH[0] = np.empty(n, np.float32)
    return _SCRATCH[0][:n]


def _adam(opt, t, param, grad, state):
    b1, b2 = opt.betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m += np.float32(1 - b1) * (grad - m)
    v *= np.float32(b2)
    v += np.float32(1 - b2) * grad * grad
    step_size = opt.lr / (1 - b1 ** t)
    denom = np.sqrt(v) / np.float32((1 - b2 ** t) ** 0.5) + np.float32(opt.eps)
    param -= np.float32(step_size) * (m / denom)
