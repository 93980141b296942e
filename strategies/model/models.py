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

Today's shapes, each a keyword whose default is GPT-2's (`--kv-heads`, `--ffn-hidden`,
`--gated-mlp` on the command line):

    kv_heads    grouped-query attention (Ainslie et al. 2023): the heads share kv_heads
                heads of keys and values, query head i reading key-value head
                i // (heads / kv_heads); qkv is d x (d + 2 d_kv), d_kv = kv_heads d / heads
                (multi-query attention: kv_heads = 1; default: the heads)
    ffn_hidden  the MLP's width f (default 4 d)
    gated_mlp   SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"; LLaMA):
                down(silu(x W1) * (x W3)) with three matrices W1, W3 (d -> f) and W2
                (f -> d), where GPT's MLP has two.  W1 and W3 are stored stacked, one
                (2f, d) matrix, as Megatron-LM's fc1 stores them: the MLP is then the
                same column-parallel / row-parallel pair as GPT's (tensor_parallel.py),
                only its activation differs (`SwiGLU`).

    x --LN--> qkv: [q (d) | k (d_kv) | v (d_kv)] --> heads --> proj --> + x
      --LN--> mlp.0: [x W1 (f) | x W3 (f)] --> silu(.) * (.) --> mlp.2 (W2) --> + ...
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


def causal_attention(q, k, v, heads, kv_heads=None):
    """Causal attention of q (B, T, C) cut into `heads` heads over k, v (B, T, C_kv) cut
    into `kv_heads` heads of the same width (default: `heads`): (B, T, C).  Each key-value
    head serves heads / kv_heads query heads in a row (grouped-query attention)."""
    kv_heads = kv_heads or heads
    B, T, C = q.shape
    width = C // heads                                     # one head's features
    # (B, T, n * width) -> (B, n, T, width)
    q = q.view(B, T, heads, width).transpose(1, 2)
    k, v = (t.view(B, T, kv_heads, width).transpose(1, 2) for t in (k, v))
    if kv_heads != heads:   # query head i reads key-value head i // group, as Megatron-LM
        group = heads // kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, C)


class CausalSelfAttention(nn.Module):
    """qkv, the heads, proj; `heads` query heads over `kv_heads` key-value heads.
    `core(q, k, v, heads, kv_heads)` is the attention between the projections:
    causal_attention here; context parallelism puts one that sees the other ranks'
    positions in its place (parallel/ring_attention.py, parallel/ulysses.py)."""

    def __init__(self, d_model, heads, kv_heads=None):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.width = d_model // heads                      # one head's features
        self.qkv = nn.Linear(d_model, d_model + 2 * self.kv_heads * self.width)
        self.proj = nn.Linear(d_model, d_model)
        self.core = causal_attention

    def forward(self, x):
        # q, k, v are three row blocks of qkv: heads, kv_heads, kv_heads heads wide
        q, k, v = self.qkv(x).split([self.heads * self.width] +
                                    [self.kv_heads * self.width] * 2, dim=2)
        return self.proj(self.core(q, k, v, self.heads, self.kv_heads))


def repeat_kv(t, heads, kv_heads):
    """k or v (B, T, kv_heads * width) as (B, T, heads * width): each key-value head
    repeated for the heads / kv_heads query heads it serves (grouped-query attention's
    reading, for attention cores that take as many key-value heads as query heads)."""
    if kv_heads == heads:
        return t
    B, T, C_kv = t.shape
    width = C_kv // kv_heads
    return t.view(B, T, kv_heads, width).repeat_interleave(heads // kv_heads, dim=2) \
        .reshape(B, T, heads * width)


class SwiGLU(nn.Module):
    """The gated MLP's activation: its input is [x W1 | x W3], its output silu(x W1) * (x W3)."""

    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def feed_forward(d_model, ffn_hidden=None, gated_mlp=False):
    """The block's MLP, a Sequential: (in, activation, out), so that its parameters are
    `mlp.0`, `mlp.2` in either form, and tensor parallelism cuts both alike."""
    f = ffn_hidden or 4 * d_model
    if gated_mlp:                  # W1 and W3 stacked: (2f, d), then W2
        return nn.Sequential(nn.Linear(d_model, 2 * f), SwiGLU(), nn.Linear(f, d_model))
    return nn.Sequential(nn.Linear(d_model, f), nn.GELU(), nn.Linear(f, d_model))


class Block(nn.Module):
    def __init__(self, d_model, heads, kv_heads=None, ffn_hidden=None, gated_mlp=False):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, kv_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = feed_forward(d_model, ffn_hidden, gated_mlp)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PositionEmbedding(nn.Embedding):
    """The learned position embeddings of the T positions; `positions` are the global
    positions of the tokens this rank holds, in its order: None for 0 .. T - 1, or the
    cp rank's where context parallelism gives it part of every sequence
    (parallel/context_order.py), whose tokens must be embedded at their own positions,
    not at 0 .. T / cp - 1."""
    positions = None

    def of_length(self, T, device):
        if self.positions is None:
            return self(torch.arange(T, device=device))
        # the embeddings broadcast over the batch: a length that does not match would
        # broadcast too (T = 1), each token at a wrong position
        if len(self.positions) != T:
            raise ValueError(f"{T} tokens against this rank's {len(self.positions)} "
                             f"positions: a cp rank holds seq_len / cp tokens of each "
                             f"sequence (parallel/context_order.py)")
        return self(self.positions.to(device))


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, layers, d_model, heads, kv_heads=None,
                 ffn_hidden=None, gated_mlp=False):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = PositionEmbedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, kv_heads, ffn_hidden, gated_mlp)
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos.of_length(idx.shape[1], idx.device)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def criterion(self, logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class MoEGPT(GPT):
    """The GPT, each block's MLP a mixture of experts (moe.py); its loss adds every
    block's load-balancing loss of the same forward."""

    def __init__(self, vocab, seq_len, layers, d_model, heads, make_moe, kv_heads=None):
        super().__init__(vocab, seq_len, layers, d_model, heads, kv_heads)
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
                                   cfg.moe_group, cfg.balance_loss), cfg.kv_heads or None)
    else:       # kv_heads, ffn_hidden: 0 = the default shape's
        model = GPT(spec.vocab, cfg.seq_len, cfg.layers, cfg.d_model, cfg.heads,
                    cfg.kv_heads or None, cfg.ffn_hidden or None, cfg.gated_mlp)
    return model.to(device)


def signature(model):
    """What a checkpoint must match: the parameter names and shapes."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())
