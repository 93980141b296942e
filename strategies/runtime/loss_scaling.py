"""fp16's dynamic loss scale, kept on the host or on the gradients' device.

Micikevicius et al., "Mixed Precision Training" (ICLR 2018), section 3.2, with
the rule of torch.amp's GradScaler: an inf or NaN among the gradients halves the
scale S and skips the update; `window` clean steps in a row double S.

Two keepers of that rule, one contract (precision.py's MixedPrecision uses either):

    LossScaler        S, the clean steps and the skips are Python numbers; the
                      overflow is a Python bool.  The CPU's path: reading a CPU
                      tensor costs nothing.
    DeviceLossScaler  S, the clean steps, the skips and the overflow flag
                      `found_inf` are one-element tensors beside the gradients
                      (GradScaler's way).  On a GPU, reading a flag on the host
                      waits for the whole backward; this keeper never does on
                      the common path, so the CPU queues the next step's forward
                      while the GPU still runs this one.

One fp16 step of DeviceLossScaler, every line a kernel, none a host read:

    1  found_inf := 0; torch._amp_foreach_non_finite_check_and_unscale_:
       every gradient *= 1/S in place, found_inf := 1 where any is inf or NaN
    2  the ranks' vote, where ranks hold different gradients: an all-reduce(max)
       of found_inf through the collective (precision.any_rank)
    3  the update, its optimizers stepping only where found_inf == 0 (SkipWhereFound)
    4  torch._amp_update_scale_: S / 2 and clean := 0 where found_inf, else
       clean += 1 and S * 2 once clean == window; skips += found_inf

The host reads that remain, each where it cannot be helped:
  - the step record's loss_scale and overflow_skips: one read of both at record
    time (`snapshot`), beside the loss the loop reads every step anyway;
  - an optimizer keeping state on the host (torch's Adam unless fused or
    capturable counts its steps in a CPU tensor), and a step that creates an
    optimizer's state (its first, SGD's momentum buffers): whether to undo it
    is decided on the host (SkipWhereFound);
  - the vote over MPI (any_rank_of, or a collective staged through host memory):
    MPI reads host memory, so the flag goes down when the gradients are done.
"""
import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ..config.choices import ConfigError

GROWTH, BACKOFF = 2.0, 0.5


def check_scale(scale, window):
    if not scale > 0 or window < 1:
        raise ConfigError(f"loss scale {scale} must be > 0 and its window {window} >= 1",
                          field="loss_scale")


class LossScaler:
    """The scale on the host: halve on overflow and skip the step, double after
    `window` clean steps."""

    def __init__(self, scale=2.0**16, window=2000):
        check_scale(scale, window)
        self.scale, self.window = float(scale), int(window)
        self.clean_steps = 0            # in a row, since the last overflow or growth
        self.overflow_skips = 0         # steps skipped so far

    @property
    def multiplier(self):
        """What the loss is multiplied by before backward."""
        return self.scale

    @staticmethod
    def overflowed(grads):
        """Whether any of the gradients holds an inf or a NaN."""
        return any(not torch.isfinite(g).all() for g in grads if g is not None)

    def update(self, overflow):
        """The scale after this step; True where the step is to be taken."""
        if overflow:
            self.scale *= BACKOFF
            self.clean_steps = 0
            self.overflow_skips += 1
            return False
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.scale *= GROWTH
            self.clean_steps = 0
        return True

    def snapshot(self):
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "overflow_skips": self.overflow_skips}

    def restore(self, state):
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
        self.overflow_skips = state["overflow_skips"]


class DeviceLossScaler:
    """The scale as tensors on `device`, updated by kernels (steps 1 and 4 above)."""

    def __init__(self, scale=2.0**16, window=2000, device="cpu"):
        check_scale(scale, window)
        self.window = int(window)
        self.multiplier = torch.full((), float(scale), dtype=torch.float32, device=device)
        self.clean = torch.zeros((), dtype=torch.int32, device=device)
        self.skips = torch.zeros((), dtype=torch.int64, device=device)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)  # 1-D: a wire buffer

    def unscale(self, grads):
        """Step 1: grads /= S in place; found_inf: 1.0 where any was inf or NaN."""
        present = [g for g in grads if g is not None]
        if present and present[0].device != self.found_inf.device:
            self.to(present[0].device)     # "cuda" was the current GPU when made
        self.found_inf.zero_()
        # GradScaler's reciprocal: in float64, then float32, as 1.0 / scale on the host
        inv_scale = self.multiplier.double().reciprocal().float()
        by_dtype = {}
        for g in present:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():   # one fused kernel per dtype
            torch._amp_foreach_non_finite_check_and_unscale_(same, self.found_inf, inv_scale)
        return self.found_inf

    def to(self, device):
        for name in ("multiplier", "clean", "skips", "found_inf"):
            setattr(self, name, getattr(self, name).to(device))

    def update(self, found_inf):
        """Step 4, on the device.  The scale stops growing where doubling it would
        overflow float32 (torch's kernel), which the host's float64 reaches later."""
        torch._amp_update_scale_(self.multiplier, self.clean, found_inf,
                                 GROWTH, BACKOFF, self.window)
        self.skips.add_(found_inf.view(()).to(torch.int64))

    def snapshot(self):
        # one transfer for the three (a host read: at record or checkpoint time only)
        scale, clean, skips = torch.stack([self.multiplier.double(), self.clean.double(),
                                           self.skips.double()]).tolist()
        return {"scale": scale, "clean_steps": int(clean), "overflow_skips": int(skips)}

    def restore(self, state):
        self.multiplier.fill_(state["scale"])
        self.clean.fill_(state["clean_steps"])
        self.skips.fill_(state["overflow_skips"])

    # what callers read on the host (DistributedOptimizer's properties): each a read
    scale = property(lambda self: self.snapshot()["scale"])
    clean_steps = property(lambda self: self.snapshot()["clean_steps"])
    overflow_skips = property(lambda self: self.snapshot()["overflow_skips"])


class SkipWhereFound:
    """Inside it, every optimizer step takes effect only where found_inf == 0.

    The update belongs to the caller (the loop steps the model's optimizer; ZeRO
    steps its fp32 masters, then casts them to the 16-bit weights), and so does
    knowing its optimizers: torch's global step hooks meet each one as it steps.
    Before and after each step, by what the optimizer holds:

      fused (torch marks it _step_supports_amp_scaling: fused Adam, AdamW, SGD)
          found_inf is handed to the kernel, which leaves the parameters and the
          state as they were (the step count included)
      its state all tensors on found_inf's device (SGD, capturable Adam)
          the parameters and the state are copied before the step and put back
          after by torch.where(found_inf, before, after): a mask, not a branch
      state on the host (Adam's CPU step count) or not a tensor
          found_inf is read on the host, and a skipped step undone from a copy

    A step that creates state (the first; SGD's momentum buffers; Adam's moments)
    cannot be masked back to "no state": where found_inf, read on the host, the
    new entries are dropped.  A step after which the state is unchanged by key
    (every one after the first, for torch's optimizers) reads nothing on the host.
    """

    def __init__(self, found_inf):
        self.found_inf = found_inf
        self.skip = found_inf.view(()) > 0
        self.pending, self.depth = {}, {}

    def __enter__(self):
        self.hooks = [register_optimizer_step_pre_hook(self.before),
                      register_optimizer_step_post_hook(self.after)]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()

    def before(self, optimizer, args, kwargs):
        # a subclass's step calling its base's fires the hooks again, inside: the
        # outermost pair is the step
        self.depth[optimizer] = self.depth.get(optimizer, 0) + 1
        if self.depth[optimizer] > 1:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None]
        had = {p: dict(optimizer.state[p]) for p in params if p in optimizer.state}
        values = [v for state in had.values() for v in state.values()]
        on_device = all(torch.is_tensor(v) and v.device == self.found_inf.device
                        for v in values)
        if on_device and getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale, optimizer.found_inf = None, self.found_inf.view(())
            mode = "fused"
        elif on_device:
            mode = "mask"
        elif bool(self.skip):                               # a host read
            mode = "undo"
        else:
            return                                          # a step to take as it is
        copies = None if mode == "fused" else (
            [p.detach().clone() for p in params],
            {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
             for p, state in had.items()})
        self.pending[optimizer] = (mode, params, had, copies)

    @torch.no_grad()
    def after(self, optimizer, args, kwargs):
        self.depth[optimizer] -= 1
        if self.depth[optimizer] or optimizer not in self.pending:
            return
        mode, params, had, copies = self.pending.pop(optimizer)
        if mode == "fused":
            del optimizer.grad_scale, optimizer.found_inf
        if mode == "mask":                                  # no host read
            old_params, old_state = copies
            for p, old in zip(params, old_params):
                p.copy_(torch.where(self.skip, old, p))
            for p, state in old_state.items():
                for k, old in state.items():
                    now = optimizer.state[p][k]
                    now.copy_(torch.where(self.skip, old, now))
        created = [(p, k) for p in params for k in optimizer.state.get(p, {})
                   if k not in had.get(p, {})]
        if mode == "undo":                                  # skipped, decided on the host
            for p, old in zip(params, copies[0]):
                p.copy_(old)
            for p, state in copies[1].items():
                optimizer.state[p] = state
            created = [(p, k) for p, k in created if p not in had]
        if created and bool(self.skip):                     # a host read: drop new state
            for p, k in created:
                del optimizer.state[p][k]
                if not optimizer.state[p]:
                    del optimizer.state[p]
