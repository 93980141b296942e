"""The models: an MLP whose size sets the compute/communication balance, a small GPT, and
the GPT with a mixture of experts for each block's MLP (moe.py).

    model = build_model(cfg, spec)     # spec from data.py: input size, classes or vocabulary
    loss = model.criterion(model(x), y)   # mean over the batch (and tokens), a scalar

The loss is split from the forward so that a wrapper (DDP in bench.py) can
run the forward while the model still names its criterion.

An MLP of width w and depth d has about d * w^2 parameters but costs only
6 * d * w^2 flops per sample (forward + backward), so a wide MLP on a small
batch is communication-bound and a narrow one on a big batch compute-bound.

The GPT is the decoder of Radford et al. (2019) at toy scale, as in nanoGPT:
token + position embeddings, pre-LayerNorm blocks of causal self-attention and
a 4x GELU MLP, a final LayerNorm and an (untied) linear head.  No dropout, so a
step is a deterministic function of parameters and batch: that is what lets
P ranks reproduce one process exactly.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .moe import MoE


class MLP(nn.Module):
    def __init__(self, in_dim, width, depth, out_dim, task="classify"):
        super().__init__()
        dims = [in_dim] + [width] * depth
        layers = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(dims[-1], out_dim))
        self.net = nn.Sequential(*layers)
        self.task = task

    def forward(self, x):
        return self.net(x)

    def criterion(self, out, y):
        if self.task == "classify":
            return F.cross_entropy(out, y)
        return F.mse_loss(out, y)


def causal_attention(q, k, v, heads):
    """Causal attention of q, k, v (B, T, C), each cut into `heads` heads: (B, T, C)."""
    B, T, C = q.shape
    # (B, T, C) -> (B, heads, T, C / heads)
    q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, C)


class CausalSelfAttention(nn.Module):
    """`core(q, k, v, heads)` is the attention between the projections: causal_attention
    here; context parallelism puts one that sees the other ranks' positions in its place
    (parallel/ring_attention.py, parallel/ulysses.py)."""

    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.core = causal_attention

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=2)
        return self.proj(self.core(q, k, v, self.heads))


class Block(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, layers, d_model, heads):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def criterion(self, logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class MoEGPT(GPT):
    """The GPT, each block's MLP a mixture of experts (moe.py); its loss adds every
    block's load-balancing loss of the same forward."""

    def __init__(self, vocab, seq_len, layers, d_model, heads, make_moe):
        super().__init__(vocab, seq_len, layers, d_model, heads)
        for block in self.blocks:
            block.mlp = make_moe()

    def criterion(self, logits, y):
        return super().criterion(logits, y) + sum(b.mlp.balance_loss for b in self.blocks)

    def token_loss(self, logits, y):
        """The cross-entropy alone: a pipeline's stages add their balance losses
        themselves (parallel/pipeline.py's Stage.balance_loss), each its own blocks'."""
        return super().criterion(logits, y)


def build_model(cfg, spec, device="cpu"):
    """The model of cfg, sized by the data's spec; every rank builds the same one
    from the same seed (and the sync broadcasts rank 0's anyway)."""
    torch.manual_seed(cfg.seed)
    if cfg.model == "mlp":
        model = MLP(spec.in_dim, cfg.width, cfg.depth, spec.out_dim, spec.task)
    elif cfg.model == "moe":
        model = MoEGPT(spec.vocab, cfg.seq_len, cfg.layers, cfg.d_model, cfg.heads,
                       lambda: MoE(cfg.d_model, cfg.experts, cfg.top_k, cfg.capacity_factor,
                                   cfg.moe_group, cfg.balance_loss))
    else:
        model = GPT(spec.vocab, cfg.seq_len, cfg.layers, cfg.d_model, cfg.heads)
    return model.to(device)


def signature(model):
    """What a checkpoint must match: the parameter names and shapes."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())
