"""Pipeline parallelism: the model's blocks cut into pp stages, micro-batches flowing through.

The cut (`layers_of`, `stage_sizes`, `stage_layers`): the GPT is embed, blocks
0..L-1, head; the MLP is its hidden layers 0..d-1 then the output layer.  Stage s
of p owns n_s consecutive blocks; stage 0 also the embedding, stage p-1 the head
and the loss.  The n_s are stages.py's balanced split, any p <= L, with the
embedding and the head weighed in blocks' worth by their forward FLOPs a token
(`token_flops`): 7 GPT blocks on 3 stages are 2, 3, 2 (the ends carry a little
more than their blocks), 8 on 4 are 2 each; --pp-layers 2,3,2 sets them by hand.
Activations go forward and their gradients backward through the point-to-point
transport of allreduce/ (the pp communicator: rank i is stage i); both sides know
every message's shape from the config and the micro-batch bounds, so only raw
float32 bytes travel (a GPT's activation holds this rank's positions: all T, or its
slice under --cp and --sequence-parallel, which its peers on the pp axis share).  A
message is received on the device the stage computes on (the batch's); on a GPU
whose MPI reads host memory only, the transport stages it through pinned host
memory (allreduce.host_staged).

Two schedules of m micro-batches on p stages (F = forward, B = backward):

    GPipe (Huang et al., 2019): all forwards, then all backwards.
        stage 0:  F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
        stage 1:  .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .      (p = 2 shown loosely)
    1F1B (PipeDream-Flush, Narayanan et al., 2021): p-s-1 warm-up forwards,
        then alternate one forward and one backward, then drain the backwards.
        stage 0:  F0 F1 B0 F2 B1 F3 B2 B3     (p = 2: warm-up of 1)
        stage 1:  F0 B0 F1 B1 F2 B2 F3 B3

Both have the same bubble, (p-1)/(m+p-1) of the step when a forward and a
backward take the same time on every stage (GPipe paper, section 2.2), but
GPipe keeps all m micro-batches' activations alive on stage 0 at the end of
the forwards, 1F1B at most p: why 1F1B is the default in Megatron-LM.

A third schedule, interleaved 1F1B (interleaved.py), gives each rank v chunks of
layers and keeps this class's messages: Pipeline takes a list of chunks, and a
message's tag names its sending global stage (chunk x stages + stage).

Every micro-batch's loss is scaled by its share of the local batch, so the
accumulated gradient is the gradient of the mean over the whole batch, as on
one process.
"""
from contextlib import nullcontext

import torch
import torch.nn as nn

from allreduce import shard_bounds
from allreduce.staging import HostStagedTransport
from allreduce.transport import MPITransport

from ..model.models import GPT, MLP, CausalSelfAttention
from ..model.moe import MoE
from ..runtime.precision import MixedPrecision, as_wire
from . import stages

SPINS = 200_000        # polls (~0.1 s) before falling back to the transport's yielding wait



class GPTEmbed(nn.Module):
    """Token + position embeddings: the first layer of the GPT (stage 0)."""

    def __init__(self, gpt):
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos

    def forward(self, idx):
        return self.tok(idx) + self.pos.of_length(idx.shape[1], idx.device)


class GPTHead(nn.Module):
    """Final LayerNorm and the vocabulary projection: the last layer (stage p-1)."""

    def __init__(self, gpt):
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x):
        return self.head(self.ln_f(x))


def layers_of(model):
    """(before, blocks, after): lists of (name, module); running them in order is model(x)."""
    if isinstance(model, GPT):
        return ([("embed", GPTEmbed(model))],
                [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)],
                [("head", GPTHead(model))])
    if isinstance(model, MLP):
        net = model.net
        hidden = [(f"net.{i}", nn.Sequential(net[i], net[i + 1]))
                  for i in range(0, len(net) - 1, 2)]
        return [], hidden, [(f"net.{len(net) - 1}", net[-1])]
    raise TypeError(f"no pipeline cut for {type(model).__name__}")


def token_flops(module, seq_len):
    """The forward FLOPs one token costs in `module`: 2 a weight of each matrix it passes
    (an MoE's experts: top_k of them), attention's scores and weighted sum 2 T a
    query feature (4 T, halved by the causal mask), and an embedding's lookup and add
    one a feature.  The backward is about twice the forward everywhere, so the forward's
    ratios are the step's."""
    if isinstance(module, MoE):
        experts = sum(token_flops(e, seq_len) for e in module.experts.values())
        return token_flops(module.gate, seq_len) + experts * module.top_k / module.num_experts
    if isinstance(module, nn.Linear):
        return 2 * module.weight.numel()
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    scores = 2 * seq_len * module.proj.in_features \
        if isinstance(module, CausalSelfAttention) else 0
    return scores + sum(token_flops(child, seq_len) for child in module.children())


def stage_sizes(model, pp, given=None):
    """[blocks of stage 0, ..., of stage pp - 1]: `given` (--pp-layers) checked, or
    stages.py's balanced split with the layers before the blocks (the embedding) and
    after them (the head) counted in blocks' worth of FLOPs on the first and last stage."""
    before, blocks, after = layers_of(model)
    if given is not None:
        return stages.stage_layers(len(blocks), pp, given=given)
    seq_len = getattr(model, "seq_len", 1)

    def work(layers):
        return sum(token_flops(module, seq_len) for _, module in layers)

    block = work(blocks) / len(blocks)
    return stages.stage_layers(len(blocks), pp, work(before) / block, work(after) / block)


def stage_layers(model, stage, pp, sizes=None):
    """The (name, module) layers of `stage` of `pp`: its blocks of `sizes` (default
    stage_sizes's balanced split), the embedding on stage 0, the head on the last."""
    before, blocks, after = layers_of(model)
    sizes = stage_sizes(model, pp) if sizes is None else sizes
    start = sum(sizes[:stage])
    mine = blocks[start:start + sizes[stage]]
    return (before if stage == 0 else []) + mine + (after if stage == pp - 1 else [])


class Stage(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.names = [name for name, _ in layers]
        self.layers = nn.ModuleList(module for _, module in layers)
        # found once, not walked every micro-batch (a plain list: not registered twice)
        self.moe = [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def balance_loss(self):
        """The load-balancing losses of this stage's mixture-of-experts layers, of its
        last forward (model/moe.py); 0.0 where it holds none.  Each stage carries its
        own: its backward starts from it beside the gradient of its output, and the
        last stage adds the stages' values into the step's loss (Pipeline.run)."""
        return sum((m.balance_loss for m in self.moe), 0.0)


class Pipeline:
    """Runs one step's micro-batches through this rank's stage (or its v chunks).

    stage_module: a Stage, or a list of v Stages (interleaved.py: chunk c of rank s is
        the global stage c * stages + s of stages * v; activations leave the last rank
        for the first one's next chunk).
    transport: point-to-point over the pp communicator (rank i = stage i).
    activation_shape(n): shape of the activation between stages for n samples.
    meter: memory.ActivationMeter around every forward; tracer: trace.Tracer;
    precision: precision.MixedPrecision (autocast, the scaled loss; None: fp32)."""

    def __init__(self, stage_module, criterion, transport, stage, stages, micro_batches,
                 schedule, activation_shape, tracer, meter, precision=None):
        self.chunks = list(stage_module) if isinstance(stage_module, (list, tuple)) \
            else [stage_module]
        self.criterion, self.transport = criterion, transport
        self.stage, self.stages, self.m = stage, stages, micro_batches
        self.schedule, self.activation_shape = schedule, activation_shape
        self.tracer, self.meter = tracer, meter
        self.precision = precision or MixedPrecision()
        self.recompute = None           # a recompute.Recompute of --recompute (parallelize.py)
        self.global_stages = stages * len(self.chunks)
        self.last = stage == stages - 1        # the rank that holds the loss
        # an MPI request can be tested without blocking; other transports' handles wait
        moves = transport.inner if isinstance(transport, HostStagedTransport) else transport
        self.spins = isinstance(moves, MPITransport)
        self.peak_in_flight = 0         # micro-batches forwarded but not yet backwarded
        self.micro_batch_bytes = 0      # saved activations of micro-batch 0, measured
        # balance losses to add (getattr: the schedule's unit tests pass no stages)
        self.has_experts = any(getattr(c, "moe", None) for c in self.chunks)

    def order(self):
        """This stage's sequence of ("F", i) and ("B", i)."""
        m = self.m
        if self.schedule == "gpipe":
            return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        warmup = min(self.stages - self.stage - 1, m)
        ops = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [("F", warmup + i), ("B", i)]
        return ops + [("B", i) for i in range(m - warmup, m)]

    def replaying(self):
        """--recompute (recompute.py): the blocks' forwards inside a backward are replays."""
        return self.recompute.backward() if self.recompute else nullcontext()

    def ops(self):
        """(op, chunk, micro-batch) in this rank's order; one chunk here, v in interleaved.py."""
        return [(op, 0, i) for op, i in self.order()]

    def run(self, x, y, step=None):
        """One step's forwards and backwards; returns the loss (last stage) or None.
        (`step` is the trivial schedule's, accumulation.py; spans here name micro-batches.)"""
        n = len(x)
        self.bounds = shard_bounds(n, self.m)
        self.x, self.y, self.n = x, y, n
        self.device = x.device          # where the stages compute: messages land there
        self.saved, self.sends, self.loss = {}, [], 0.0
        self.balance = 0.0              # the balance losses of this rank's other stages
        self.in_flight = 0
        self.micro_batch_bytes = 0
        for op, chunk, i in self.ops():
            (self.forward if op == "F" else self.backward)(i, chunk)
        with self.tracer.span("wait for sends", "comm"):
            self.transport.wait_all([h for h, _ in self.sends])
        self.sends = []
        if self.has_experts:            # every stage's balance loss into the step's loss
            self.loss += self.balance_of_other_stages()
        return self.loss if self.last else None

    def balance_of_other_stages(self):
        """The last rank: the sum of the other chunks' balance losses (every rank sends
        its own, one float64, after the step's messages); elsewhere 0 after sending."""
        tag = 2 * self.global_stages * self.m        # above every micro-batch's tag
        mine = torch.tensor([float(self.balance)], dtype=torch.float64)
        if not self.last:
            self.transport.isend(mine, self.stages - 1, tag=tag).wait()
            return 0.0
        total = float(self.balance)
        for peer in range(self.stages - 1):
            theirs = torch.empty(1, dtype=torch.float64)
            self.transport.irecv(theirs, peer, tag).wait()
            total += float(theirs[0])
        return total

    # The global stage g = chunk * stages + stage: its input comes from g - 1 on the rank
    # before (the last rank's for chunk > 0 of rank 0), its output goes to g + 1.  A
    # message's tag is (sending global stage, micro-batch, direction), unique in a step.
    def global_stage(self, chunk):
        return chunk * self.stages + self.stage

    def tag(self, sender, i, gradient):
        return 2 * (sender * self.m + i) + gradient

    def receive(self, buf, peer, tag):
        """A blocking receive that spins instead of yielding the core: on a loaded host a
        process that yields may sleep for a whole time slice (ms, as long as a micro-batch),
        which would add to every bubble.  The transport's own wait keeps the timeout and
        ends a staged receive (its copy up), at once where the spin saw the message."""
        handle = self.transport.irecv(buf, peer, tag)
        if self.spins:
            request = handle.request
            for _ in range(SPINS):
                if request.Test():
                    break
        handle.wait()

    def _name(self, i, chunk):
        return f"mb{i}" if len(self.chunks) == 1 else f"mb{i} chunk{chunk}"

    def forward(self, i, chunk=0):
        g = self.global_stage(chunk)
        first, last = g == 0, g == self.global_stages - 1
        start, stop = self.bounds[i]
        if first:
            inp = self.x[start:stop].clone()    # its own storage, as a loader would give
        else:
            inp = torch.empty(self.activation_shape(stop - start), device=self.device)
            with self.tracer.span(f"wait activation {self._name(i, chunk)}", "idle"):
                self.receive(inp, (self.stage - 1) % self.stages, self.tag(g - 1, i, 0))
            if self.precision.mixed:    # fp32 on the wire; the stage computes as the last did
                inp = inp.to(self.precision.half)
            inp.requires_grad_()
        before = self.meter.live_bytes
        share = (stop - start) / self.n
        with self.tracer.span(f"forward {self._name(i, chunk)}", "forward"), self.meter, \
                self.precision.autocast():
            out = self.chunks[chunk](inp)
            # a mixture of experts: this micro-batch's balance loss of the chunk's layers,
            # a share of the step's as its cross-entropy is
            balance = self.chunks[chunk].balance_loss() * share
            if last:
                out = self.criterion(out, self.y[start:stop]) * share + balance
                self.loss += out.item()
            elif torch.is_tensor(balance):          # read once a step (no host wait here)
                self.balance = self.balance + balance.detach().double()
        if i == 0:                      # what one micro-batch's saved activations cost
            self.micro_batch_bytes += self.meter.live_bytes - before
        if not last:
            buf = as_wire(out.detach())                 # fp32, as received
            self.sends.append((self.transport.isend(buf, (self.stage + 1) % self.stages,
                                                    tag=self.tag(g, i, 0)), buf))
        self.saved[chunk, i] = (inp, out, None if last else balance)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def backward(self, i, chunk=0):
        g = self.global_stage(chunk)
        inp, out, balance = self.saved.pop((chunk, i))
        name = self._name(i, chunk)
        if g == self.global_stages - 1:
            with self.tracer.span(f"backward {name}", "backward"), self.replaying():
                self.precision.backward(out)          # fp16: of the scaled loss
        else:
            grad = torch.empty(out.shape, device=self.device)
            with self.tracer.span(f"wait gradient {name}", "idle"):
                self.receive(grad, (self.stage + 1) % self.stages, self.tag(g + 1, i, 1))
            with self.tracer.span(f"backward {name}", "backward"), self.replaying():
                if torch.is_tensor(balance):          # the stage's own loss term too,
                    self.precision.backward(balance, out, grad.to(out.dtype))   # scaled
                else:
                    out.backward(grad.to(out.dtype))      # bf16 under --precision bf16
        del out
        if g > 0:
            g_in = as_wire(inp.grad)
            self.sends.append((self.transport.isend(g_in, (self.stage - 1) % self.stages,
                                                    tag=self.tag(g, i, 1)), g_in))
        self.in_flight -= 1
