"""What a GPT of a given shape costs: parameters, FLOPs and activation bytes, in one home.

    gpt = GPT(layers=24, d_model=2304, heads=24, seq_len=2048, vocab=51200, global_batch=512)
    parameters(gpt)                          # 1.7e9: Narayanan et al.'s count
    step_flops(gpt, "full")                  # 96 B s l h^2 (1 + s/6h + V/16lh)
    layer_activation_bytes(gpt, b=1, tp=8, sequence_parallel=True, recompute="selective")
    GPT(126, 16384, 128, 8192, 128256, 2048, kv_heads=8, ffn_hidden=53248, gated_mlp=True)

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC21), Appendix: a transformer layer's forward on b
sequences of s tokens of width h multiplies 24 b s h^2 (the QKV projection 6,
the attention's output 2, the MLP's two 4h matrices 16) plus 4 b s^2 h (the
scores Q K^T and their weighted sum of V).  The backward takes twice the
forward, and full recomputation runs the forward once more: 4 forwards' worth,
the 96 of their formula, with the logit layer's 6 b s h V (forward 2, backward
4, never recomputed):

    F = 96 B s l h^2 (1 + s / 6h + V / 16 l h)       (full recomputation)
    F = 72 B s l h^2 (1 + s / 6h + V / 12 l h)       (none)

Today's shapes generalise the three matrices (each term 2 b s x its weights):
grouped-query attention (Ainslie et al. 2023) keeps kv_heads < heads heads of
keys and values, so the QKV projection is h x (h + 2 h_kv), h_kv = kv_heads h /
heads (multi-query attention: kv_heads = 1); the MLP has its own width f
(--ffn-hidden; 4h in GPT-3); a gated MLP (SwiGLU, Shazeer 2020; LLaMA) has three
f x h matrices, the gate's, the up projection's and the down projection's,
where GPT's has two.  The forward of a layer is then

    2 b s h (h + 2 h_kv)  +  2 b s h^2  +  2 b s h f (2, or 3 gated)  +  4 b s^2 h

which is 24 b s h^2 + 4 b s^2 h again at h_kv = h, f = 4h, not gated.  The
scores still take every query head: GQA shares keys, not queries.

Selective recomputation (Korthikanti et al. 2022, section 5) runs only the
attention core again: 4 b s^2 h more a layer.  In a mixture of experts each
token passes through top_k experts' MLPs: the MLP's FLOPs count top_k times.

Parameters (the same paper): 12 l h^2 (1 + 13/12h + (V + s)/12lh): the layers'
weights 12 h^2 and biases and norms 13 h, and the word and position embeddings;
in general a layer's attention holds h (h + 2 h_kv) + h^2 weights, (h + 2 h_kv)
+ h biases and two norms' 4 h, its MLP 2 or 3 h f weights and f (2 f gated) + h
biases; an MoE layer holds its experts' MLPs instead of one.

Activations: Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), Table 2, bytes a layer holds for its backward with
16-bit activations and 1-byte dropout masks, a the heads and t the tensor-parallel size:

    tensor parallel                     s b h (10 + 24/t + 5 a s / h t)
    + sequence parallel                 s b h (34/t + 5 a s / h t)
    + selective recomputation           s b h (10 + 24/t)        or  s b h 34/t with SP
    full recomputation                  2 s b h (the layer's input)  or  2 s b h / t with SP

The 24 split over t is their section 4.1's sum: Q, K, V and the output
projection's input (2 + 2 + 2 + 2 s b h) and the MLP's two 4h-wide tensors (8 + 8);
with GQA K and V are h_kv wide (4 h + 4 h_kv), with width f the MLP keeps 4 f
(the first matrix's output and GeLU's), and a gated MLP 6 f (Megatron's fused
SwiGLU keeps the gate's and the up projection's outputs, 4 f, and the down
projection's input, 2 f).  The 10 (norms' inputs 4, the attention's and the
MLP's inputs 2 + 2, the two dropout masks 1 + 1) is unchanged.  A fused attention
core (flash attention, Dao et al. 2022) never stores the scores: the 5 a s / h t
term goes, as under selective recomputation, and so does its traffic (kernels.py).

Their models drop out (GPT-3's recipe).  A model trained without dropout
(GPT.dropout False) keeps no masks: torch's dropout at p = 0 hands back its input
and stores nothing, so the 10 is 8, and the scores' 5 a s / h t (softmax output 2,
its dropout's mask 1 and output 2) is 2.  Llama's is such a model: the block of
Meta's reference code (the model.py of github.com/meta-llama/llama3) is x +
attention(norm(x)), then h + mlp(norm(h)), with no dropout, and Megatron-LM trains
Llama 3 with --attention-dropout 0.0 --hidden-dropout 0.0 (its Llama guide,
llama_mistral.md).

t = 1 gives the unparallelised s b h (34 + 5 a s / h).  In fp32 every 16-bit
activation doubles; we double the whole (the masks, 1 byte, are a small part).
Context parallelism over cp ranks (each s / cp positions of every sequence) keeps
a cp-th of each term: the scores too, s / cp queries against s keys (the ring) or
s x s of heads / cp heads (Ulysses).
"""
from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")
# context parallelism's two kinds (strategies/parallel/ring_attention.py, ulysses.py)
CONTEXT_KINDS = ("ring", "ulysses")
# Every count a GPT takes is a whole number of at most this: larger ones describe no
# model ever trained, and their products stay exact in a float.
MAX_COUNT = 2 ** 31 - 1


@dataclass(frozen=True)
class GPT:
    layers: int
    d_model: int
    heads: int
    seq_len: int
    vocab: int
    global_batch: int
    experts: int = 0            # 0: dense; E: every layer's MLP is E experts
    top_k: int = 2              # experts per token (Switch 1, GShard 2)
    kv_heads: int = None        # heads of keys and values (GQA; None: heads)
    ffn_hidden: int = None      # the MLP's width f (None: 4 d_model)
    gated_mlp: bool = False     # SwiGLU: three f x h matrices
    flash_attention: bool = False   # the attention core fused: no scores stored
    dropout: bool = True        # the blocks drop out (masks stored); False: none (Llama)

    def __post_init__(self):
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden is None and isinstance(self.d_model, int):
            object.__setattr__(self, "ffn_hidden", 4 * self.d_model)
        for name in ("layers", "d_model", "heads", "seq_len", "vocab", "global_batch",
                     "kv_heads", "ffn_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or \
                    not 1 <= value <= MAX_COUNT:
                unless = " (4 x --d-model unless given)" if name == "ffn_hidden" else ""
                raise ValueError(f"--{name.replace('_', '-')}{unless} must be a whole number "
                                 f"in 1..{MAX_COUNT}, got {value}")
        if self.d_model % self.heads:
            raise ValueError(f"--heads {self.heads} must divide --d-model {self.d_model}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--kv-heads {self.kv_heads} must divide --heads {self.heads} "
                             f"(each key-value head serves a group of query heads)")
        if not isinstance(self.experts, int) or not isinstance(self.top_k, int) or \
                not 0 <= self.experts <= MAX_COUNT or \
                (self.experts and not 1 <= self.top_k <= min(2, self.experts)):
            raise ValueError(f"--experts must be >= 0 and top-k 1 or 2 (at most the experts), "
                             f"got {self.experts} experts, top-k {self.top_k}")

    @property
    def kv_width(self):
        """h_kv: the width of the keys (and of the values), kv_heads heads of h / heads."""
        return self.kv_heads * self.d_model // self.heads

    @property
    def mlp_matrices(self):
        return 3 if self.gated_mlp else 2


def mlp_copies(gpt):
    """MLPs a layer holds (its experts) and MLPs a token passes through (top_k)."""
    return (gpt.experts, gpt.top_k) if gpt.experts else (1, 1)


def mlp_parameters(gpt):
    """One MLP's weights and biases: 2 (3 gated) h f, and f (2 f) + h."""
    h, f = gpt.d_model, gpt.ffn_hidden
    return gpt.mlp_matrices * h * f + (gpt.mlp_matrices - 1) * f + h


def attention_parameters(gpt):
    """One layer's attention and its two norms: h (h + 2 h_kv) + h^2 weights, biases, 4 h."""
    h, kv = gpt.d_model, gpt.kv_width
    return h * (h + 2 * kv) + h * h + (h + 2 * kv) + h + 4 * h


def parameters(gpt):
    """Weights of the whole model (Narayanan et al.'s count; MoE: E MLPs a layer)."""
    held = mlp_copies(gpt)[0]
    return gpt.layers * (attention_parameters(gpt) + held * mlp_parameters(gpt)) + \
        embedding_parameters(gpt)


def embedding_parameters(gpt):
    """The word and position embeddings: (V + s) h."""
    return (gpt.vocab + gpt.seq_len) * gpt.d_model


def expert_parameters(gpt):
    """The experts' share of parameters() (0 for a dense model): what ep shards."""
    return gpt.layers * gpt.experts * mlp_parameters(gpt)


def layer_gemms(gpt, b, cp=1, cp_kind="ring"):
    """[(name, m, n, k, times)] of one layer's forward on b sequences on one rank: each
    GEMM multiplies an m x k by a k x n matrix, `times` of them (the attention core:
    one a head; the MLP: top_k experts a token).  Their FLOPs, 2 m n k each, add up
    to layer_forward_flops.  On one of cp context-parallel ranks (CONTEXT_KINDS) a
    rank holds s / cp positions: the ring's queries meet every key (s / cp x s scores a
    head), Ulysses' whole sequences of heads / cp heads (s x s): a cp-th either way."""
    s, h, f, kv = gpt.seq_len, gpt.d_model, gpt.ffn_hidden, gpt.kv_width
    tokens, head_dim, passes = b * s // cp, h // gpt.heads, mlp_copies(gpt)[1]
    queries, heads = (s, b * gpt.heads // cp) if cp_kind == "ulysses" else \
        (s // cp, b * gpt.heads)
    mlp_in = ("mlp_in", tokens, (gpt.mlp_matrices - 1) * f, h, passes)
    return [("qkv", tokens, h + 2 * kv, h, 1),
            ("scores", queries, s, head_dim, heads),            # Q K^T, a head at a time
            ("context", queries, head_dim, s, heads),           # softmax(.) V
            ("attention_out", tokens, h, h, 1),
            mlp_in,
            ("mlp_out", tokens, h, f, passes)]


def layer_forward_flops(gpt, b):
    """One layer's forward on b sequences: 24 b s h^2 + 4 b s^2 h for GPT-3's shape
    (module docstring: GQA, the MLP's width, gating; MoE: the MLP top_k times)."""
    return sum(2 * m * n * k * times for _, m, n, k, times in layer_gemms(gpt, b))


def attention_core_flops(gpt, b):
    """The scores and their weighted sum on b sequences: 4 b s^2 h."""
    return 4 * b * gpt.seq_len ** 2 * gpt.d_model


def recompute_flops(gpt, b, recompute):
    """What recomputation adds to one layer's backward on b sequences."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute == "full":
        return layer_forward_flops(gpt, b)
    return attention_core_flops(gpt, b) if recompute == "selective" else 0


def logit_flops(gpt, b):
    """The logit layer's forward and backward on b sequences: 6 b s h V."""
    return 6 * b * gpt.seq_len * gpt.d_model * gpt.vocab


def step_flops(gpt, recompute="none"):
    """FLOPs of one step on the global batch, recomputation included (the paper's count;
    recompute="none" gives the model's FLOPs, what MFU counts)."""
    B = gpt.global_batch
    per_layer = 3 * layer_forward_flops(gpt, B) + recompute_flops(gpt, B, recompute)
    return gpt.layers * per_layer + logit_flops(gpt, B)


def layer_activation_bytes(gpt, b, tp=1, sequence_parallel=False, recompute="none",
                           bytes_per_value=2, cp=1):
    """Bytes one layer keeps for its backward on b sequences (Korthikanti et al., Table 2,
    with the module docstring's GQA, MLP width and gating), on one of tp tensor-parallel
    ranks and cp context-parallel ones (each keeps its s / cp positions' share of every
    term, the scores' too); bytes_per_value 4 (fp32) doubles the 16-bit figure."""
    s, h, a, t = gpt.seq_len, gpt.d_model, gpt.heads, tp
    sb = s * b / cp
    if recompute == "full":
        held = 2 * sb * h / (t if sequence_parallel else 1)
    else:
        split = 4 * h + 4 * gpt.kv_width + (6 if gpt.gated_mlp else 4) * gpt.ffn_hidden * \
            mlp_copies(gpt)[1]                       # 24 h for GPT-3's shape
        # without SP the norms' and dropouts' 10 s b h are whole on every tp rank; with
        # no dropout, no masks: 8
        whole = (10 if gpt.dropout else 8) * h
        held = sb * (whole + split) / t if sequence_parallel else sb * (whole + split / t)
        if recompute == "none" and not gpt.flash_attention:
            scores = 5 if gpt.dropout else 2           # the softmax's output, its dropout's
            held += sb * scores * a * s / t            # mask and output
        elif recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, "
                             f"got {recompute!r}")
    return held * bytes_per_value / 2


def logits_bytes(gpt, b, tp=1, cp=1):
    """The last stage's logits for the loss, in fp32 and sharded over tp (and over cp by
    position): 4 s b V / t cp."""
    return 4 * gpt.seq_len * b * gpt.vocab / (tp * cp)
