"""Activation recomputation: keep each block's input, re-run its forward during backward.

Chen, Xu, Zhang & Guestrin (2016), "Training Deep Nets with Sublinear Memory Cost":
autograd keeps every intermediate tensor of the forward that backward will need
(the activations); cut the network into segments, keep only each segment's input
(a checkpoint), and recompute the segment's insides from it when backward reaches
it.  The idea is reverse-mode checkpointing from automatic differentiation
(Griewank 1992, "Achieving logarithmic growth of temporal and spatial complexity in
reverse automatic differentiation"; Griewank & Walther 2000, "Algorithm 799: revolve").

    without --recompute                     with --recompute
    forward   block i saves its insides     block i saves its input x_i only: its
              (GPT: LayerNorm outputs,      insides are freed as soon as they are made
              q k v, attention, the MLP's
              4d hidden and its GELU)
    backward  block i's gradients from      re-run block i's forward from x_i (the
              what it saved                 "recompute" spans of --trace), then its
                                            backward; freed before block i-1 is re-run

    memory:  L blocks x (insides of one block)  ->  L x (one block input)
             + the insides of one block at a time, during backward
    time:    one more forward per block: about +1/3 of forward + backward

Segments: each GPT block is one (its insides are ~10x its input).  An MLP hidden
layer alone would win nothing: it keeps only its input (Linear) and its output
(ReLU), which is the next layer's input anyway.  So the MLP's hidden layers are cut
into segments of ceil(sqrt(depth)) layers, Chen et al.'s sqrt(n) choice, each
keeping only its input.

torch.utils.checkpoint(use_reentrant=False) does the work: it saves the inputs
under saved-tensor hooks of its own and re-runs the function at the first unpack
in backward.  The parameters keep their names (the blocks' forward is wrapped in
place), so checkpoints, --params-out and the equivalence tests see the same model.
A replay is a deterministic function of the block's input: our models have no
dropout, so the recomputed tensors are the ones the forward made, bit for bit.
"""
import math
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..config.choices import ConfigError
from ..model.models import GPT, MLP
from ..runtime.memory import ActivationMeter
from ..runtime.trace import span


class _KeptInput(torch.autograd.Function):
    """The identity, saving its input for backward.  checkpoint keeps a block's input
    by a plain reference, out of sight of saved-tensor hooks; passing it through here
    shows that storage to memory.ActivationMeter (counted once, no bytes added)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def checkpointed(run, name, forward, x):
    return checkpoint(run, name, forward, _KeptInput.apply(x), use_reentrant=False)


class Recompute:
    """The checkpointed blocks of one model.  `backward()` marks the backward pass, so
    that a block's forward run inside it is known for a replay, counted in `replays`
    and traced as a "recompute" span (trace.py)."""

    def __init__(self, model, tracer=None):
        self.tracer, self.replays, self.in_backward = tracer, 0, False
        if model is None:
            return                                 # blocks come through wrap (of_blocks)
        if isinstance(model, GPT):                 # the GPT, and its mixture of experts
            for i, block in enumerate(model.blocks):
                self._wrap(block, f"block {i}")
        elif type(model) is MLP:
            self._wrap_mlp(model)
        else:
            raise ConfigError(f"--recompute knows the blocks of mlp and gpt, not of "
                            f"{type(model).__name__}", field="recompute")

    @classmethod
    def of_blocks(cls, blocks, tracer=None):
        """The blocks a pipeline stage holds, [(name, block)], each checkpointed: the
        grid's share of the model (engine/parallelize.py).  GPT blocks are already split
        over tp, and the replay runs their collectives again, in the same order on every
        tp rank.  An MLP's hidden layer (Linear, ReLU) is a segment of its own here, not
        one of sqrt(depth) layers as in the whole model: the stages cut the model
        into layers, and a layer keeps only its input, which its ReLU output is to the
        next one anyway, so on the grid the MLP replays for time and saves no memory."""
        recompute = cls(None, tracer)
        for name, block in blocks:
            recompute._wrap(block, name)
        return recompute

    def _wrap(self, module, name):
        forward = module.forward                   # the bound method, before we replace it
        module.forward = lambda x: checkpointed(self._run, name, forward, x)

    def _wrap_mlp(self, model):
        layers = list(model.net)                   # Linear, ReLU, ..., Linear (the head)
        hidden = [layers[i:i + 2] for i in range(0, len(layers) - 1, 2)]
        per = math.ceil(math.sqrt(len(hidden)))
        # each segment run in order, its modules shared with model.net (not registered)
        segments = [nn.Sequential(*sum(hidden[i:i + per], []))
                    for i in range(0, len(hidden), per)]

        def forward(x):
            for s, seq in enumerate(segments):
                first = 1 + s * per
                x = checkpointed(self._run, f"layers {first}-{first + len(seq) // 2 - 1}",
                                 seq, x)
            return layers[-1](x)
        model.net.forward = forward                # the modules stay where they are

    def _run(self, name, forward, *args):
        if not self.in_backward:
            return forward(*args)
        self.replays += 1                          # backward re-runs the block's forward
        with span(self.tracer, f"recompute {name}", "recompute"):
            return forward(*args)

    @contextmanager
    def backward(self):
        """Around loss.backward(): the blocks' forwards inside are replays."""
        self.in_backward = True
        try:
            yield
        finally:
            self.in_backward = False


def saved_activation_bytes(model, x, y):
    """Peak bytes autograd holds for backward over one forward of (x, y), measured
    with memory.ActivationMeter (saved-tensor hooks; parameters not counted); the
    backward runs after, so the model's gradients are left filled."""
    meter = ActivationMeter(lambda: {p.untyped_storage().data_ptr()
                                     for p in model.parameters()})
    with meter:
        loss = model.criterion(model(x), y)
    peak = meter.peak_bytes
    loss.backward()
    return peak


def enable(cfg, model, tracer=None):
    """A Recompute over model's blocks if --recompute, else None."""
    return Recompute(model, tracer) if cfg.recompute else None

