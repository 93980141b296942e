"""What a GPT of a given shape costs: parameters, FLOPs and activation bytes, in one home.

    gpt = GPT(layers=24, d_model=2304, heads=24, seq_len=2048, vocab=51200, global_batch=512)
    parameters(gpt)                          # 1.7e9: Narayanan et al.'s count
    step_flops(gpt, "full")                  # 96 B s l h^2 (1 + s/6h + V/16lh)
    layer_activation_bytes(gpt, b=1, tp=8, sequence_parallel=True, recompute="selective")

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

Selective recomputation (Korthikanti et al. 2022, section 5) runs only the
attention core again: 4 b s^2 h more a layer.  In a mixture of experts each
token passes through top_k experts' MLPs: the MLP's 16 b s h^2 counts top_k times.

Parameters (the same paper): 12 l h^2 (1 + 13/12h + (V + s)/12lh): the layers'
weights 12 h^2 and biases and norms 13 h, and the word and position embeddings;
an MoE layer holds its experts' MLPs, 8 h^2 + 5 h each, instead of one.

Activations: Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), Table 2, bytes a layer holds for its backward with
16-bit activations and 1-byte dropout masks, a the heads and t the tensor-parallel size:

    tensor parallel                     s b h (10 + 24/t + 5 a s / h t)
    + sequence parallel                 s b h (34/t + 5 a s / h t)
    + selective recomputation           s b h (10 + 24/t)        or  s b h 34/t with SP
    full recomputation                  2 s b h (the layer's input)  or  2 s b h / t with SP

t = 1 gives the unparallelised s b h (34 + 5 a s / h).  In fp32 every 16-bit
activation doubles; we double the whole (the masks, 1 byte, are a small part).
"""
from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")


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

    def __post_init__(self):
        for name in ("layers", "d_model", "heads", "seq_len", "vocab", "global_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"--heads {self.heads} must divide --d-model {self.d_model}")
        if self.experts < 0 or (self.experts and not 1 <= self.top_k <= min(2, self.experts)):
            raise ValueError(f"--experts must be >= 0 and top-k 1 or 2 (at most the experts), "
                             f"got {self.experts} experts, top-k {self.top_k}")


def mlp_copies(gpt):
    """MLPs a layer holds (its experts) and MLPs a token passes through (top_k)."""
    return (gpt.experts, gpt.top_k) if gpt.experts else (1, 1)


def parameters(gpt):
    """Weights of the whole model (Narayanan et al.'s count; MoE: E MLPs a layer)."""
    h, held = gpt.d_model, mlp_copies(gpt)[0]
    attention, mlp = 4 * h * h + 8 * h, 8 * h * h + 5 * h    # 13 h: biases and 2 norms
    return gpt.layers * (attention + held * mlp) + (gpt.vocab + gpt.seq_len) * h


def expert_parameters(gpt):
    """The experts' share of parameters() (0 for a dense model): what ep shards."""
    h = gpt.d_model
    return gpt.layers * gpt.experts * (8 * h * h + 5 * h)


def layer_forward_flops(gpt, b):
    """One layer's forward on b sequences: 24 b s h^2 + 4 b s^2 h (MoE: the MLP top_k times)."""
    s, h, passes = gpt.seq_len, gpt.d_model, mlp_copies(gpt)[1]
    return b * s * h * (8 * h + 16 * h * passes + 4 * s)


def recompute_flops(gpt, b, recompute):
    """What recomputation adds to one layer's backward on b sequences."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute == "full":
        return layer_forward_flops(gpt, b)
    return 4 * b * gpt.seq_len ** 2 * gpt.d_model if recompute == "selective" else 0


def logit_flops(gpt, b):
    """The logit layer's forward and backward on b sequences: 6 b s h V."""
    return 6 * b * gpt.seq_len * gpt.d_model * gpt.vocab


def step_flops(gpt, recompute="none"):
    """FLOPs of one step on the global batch, recomputation included (the paper's count)."""
    B = gpt.global_batch
    per_layer = 3 * layer_forward_flops(gpt, B) + recompute_flops(gpt, B, recompute)
    return gpt.layers * per_layer + logit_flops(gpt, B)


def layer_activation_bytes(gpt, b, tp=1, sequence_parallel=False, recompute="none",
                           bytes_per_value=2):
    """Bytes one layer keeps for its backward on b sequences (Korthikanti et al., Table 2),
    on one of tp tensor-parallel ranks; bytes_per_value 4 (fp32) doubles the 16-bit figure."""
    s, h, a, t = gpt.seq_len, gpt.d_model, gpt.heads, tp
    sbh = s * b * h
    if recompute == "full":
        held = 2 * sbh / (t if sequence_parallel else 1)
    else:
        # without SP the norms' and dropouts' 10 s b h are whole on every tp rank
        held = sbh * (34 / t if sequence_parallel else 10 + 24 / t)
        if recompute == "none":
            held += sbh * 5 * a * s / (h * t)             # the scores, softmax and its dropout
        elif recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, "
                             f"got {recompute!r}")
    return held * bytes_per_value / 2


def logits_bytes(gpt, b, tp=1):
    """The last stage's logits for the loss, in fp32 and sharded over tp: 4 s b V / t."""
    return 4 * gpt.seq_len * b * gpt.vocab / tp
