"""A layer's compute on one GPU, kernel by kernel: a roofline whose GEMMs reach more of the
peak the larger they are.

    layer_seconds(gpt, b=1, tp=8, sequence_parallel=True, cluster=preset("dgx-h100"))
    gemm_seconds(8192, 6144, 16384, cluster)       # one m x k times k x n product

Williams, Waterman and Patterson, "Roofline" (CACM 2009): a kernel of F FLOPs
that moves Q bytes through the GPU's memory takes at least max(F / peak, Q /
bandwidth).  Two kinds of kernel make a transformer layer:

  GEMMs      the projections, the MLP's matrices, the attention core (a head's
             Q K^T and its weighted sum of V, each with the head's width as one
             dimension, all heads in one batched kernel) and the logit layer.  A
             GEMM of m x k by k x n does 2 m n k FLOPs and moves (m k + k n + m n)
             values; it runs at

                 peak x best x d / (d + D_HALF),     d = min(m, n x batch)

             best: the share of the peak the best-shaped large 16-bit GEMMs
             reach, measured per GPU (Cluster.gemm_best, the presets' sources).
             d / (d + D_HALF): a GEMM is cut into output tiles of 128 x 128 or
             more, one a streaming multiprocessor at a time, so a narrow output
             leaves SMs idle or a ragged last wave (NVIDIA's "Matrix
             Multiplication Background" guide: tile and wave quantization); a
             batched kernel's outputs fill the SMs together.  A short k shows as
             a low arithmetic intensity, which the roofline's bytes price.  (A
             matrix-vector product, n = 1, is outside this model: a layer has none.)
             D_HALF = 1024 is the one constant fitted: to Narayanan et al.'s
             Table 1 (A100s, tests/test_plan_published.py), where it stands for
             what a roofline leaves out besides the tiles (the gaps between
             kernels, the framework's host time, the scheduler's waves); it is
             held for every GPU and checked, unrefitted, against BLOOM-176B on
             A100s and Llama 3 405B on H100s.  At d = 2048 (a micro-batch of one
             2048-token sequence) a GEMM reaches two thirds of its best.
             The backward multiplies each forward GEMM twice (the input's
             gradient and the weight's), with the same three dimensions.
  streams    what reads and writes each value once or twice and computes little:
             layer norms, bias, GeLU or SwiGLU, dropout and the residual add, the
             softmax over the scores, the embedding's lookup, the loss.  They
             run at the memory's bandwidth times STREAM_SHARE; their backward
             moves about twice the forward's bytes (the output's gradient and
             the saved input read, the input's gradient written).

What a layer streams forward, s b tokens, e bytes a value, masks of 1 byte,
on one of t tp ranks:
    2 norms              2 x (read + write) s b h e     (/ t with sequence parallelism)
    2 dropout-add        2 x (3 e + 1) s b h            (/ t with sequence parallelism)
    the MLP's activation (read + write) s b f e / t, gated (read 2 + write 1)
    the scores           (3 e + 1) b a s^2 / t: scaled, masked, softmaxed (one
                         fused kernel: read, write) and dropped out (write, mask);
                         nothing with flash attention, whose softmax stays on chip.
A model without dropout (GPT.dropout False) writes no masks: the residual adds
are 3 e s b h each, and the scores 2 e b a s^2 / t.

The optimizer's update is a stream too, once a step over the parameters a rank
updates: Adam (Kingma and Ba, Algorithm 1) or SGD reads each parameter's gradient,
reads and writes its fp32 master and its moments (m, v; a momentum buffer), and
writes the parameter (`update_bytes`; Megatron-LM's and apex's fused Adam are one
kernel over these, bound by the memory, not the FLOPs).
"""
from strategies.runtime.memory import bytes_per_parameter

from .transformer import layer_gemms, mlp_copies

# a GEMM's efficiency is half its best when its output's smaller side is this (above)
D_HALF = 1024
# A streaming kernel's share of the memory's peak bandwidth: STREAM-style copies
# reach 80-90 % of HBM's datasheet figure on A100 and H100; fused elementwise
# kernels with several inputs a little less.
STREAM_SHARE = 0.8


def gemm_efficiency(m, n, cluster, times=1):
    """The share of the peak a GEMM with an m x n output reaches, `times` of them in one
    batched kernel (their tiles fill the GPU together: an m x n times output)."""
    d = min(m, n * times)
    return cluster.gemm_best * d / (d + D_HALF)


def gemm_seconds(m, n, k, cluster, e=2, times=1):
    """`times` GEMMs of m x k by k x n in e-byte values, in one kernel: the slower of
    their FLOPs at their efficiency and their bytes at the memory's bandwidth."""
    rate = cluster.gpu_tflops * 1e12 * gemm_efficiency(m, n, cluster, times)
    memory = times * e * (m * k + k * n + m * n) / (cluster.hbm_bytes_per_s * STREAM_SHARE)
    return max(times * 2 * m * n * k / rate, memory)


def stream_seconds(n_bytes, cluster):
    return n_bytes / (cluster.hbm_bytes_per_s * STREAM_SHARE)


def update_bytes(precision, optimizer, grad_bytes=None):
    """Bytes the optimizer's update moves a parameter (strategies.runtime.memory's states):
    the gradient read (grad_bytes: an fp32 main gradient's, where the optimizer keeps
    one), the optimizer's state (the fp32 master and the moments) read and written, and
    the parameter written; in fp32 the parameter is the master, read and written.
    fp32 SGD 12, with momentum 20, Adam 28; mixed Adam 2 + 2 x 12 + 2 = 28."""
    states = bytes_per_parameter(precision, optimizer)
    grad = states["grads"] if grad_bytes is None else grad_bytes
    params = 2 * states["params"] if precision == "fp32" else states["params"]
    return grad + 2 * states["optimizer"] + params


def split_gemms(gpt, b, tp, cp=1, cp_kind="ring"):
    """layer_gemms on one of tp ranks: Megatron's column-parallel matrices (QKV, the MLP's
    first) split n, the row-parallel ones (attention's output, the MLP's last) split k,
    and each rank computes heads / tp heads' attention core (of its cp-th of the
    positions: layer_gemms)."""
    split = {"qkv": (tp, 1, 1), "mlp_in": (tp, 1, 1), "attention_out": (1, tp, 1),
             "mlp_out": (1, tp, 1), "scores": (1, 1, tp), "context": (1, 1, tp)}
    for name, m, n, k, times in layer_gemms(gpt, b, cp, cp_kind):
        over_n, over_k, over_times = split[name]
        yield name, m, max(1, n / over_n), max(1, k / over_k), max(1, times / over_times)


def layer_seconds(gpt, b, tp, sequence_parallel, cluster, e=2, cp=1, cp_kind="ring"):
    """{"forward", "backward", "selective"} seconds of one layer's compute on b sequences
    on one of tp ranks (and of cp context-parallel ones: s / cp positions): backward
    without recomputation; selective: what recomputing the attention core adds to it
    (full recomputation adds "forward"), which is also the core's forward alone."""
    s, h, f, a = gpt.seq_len, gpt.d_model, gpt.ffn_hidden, gpt.heads
    gemms = {name: gemm_seconds(m, n, k, cluster, e, times)
             for name, m, n, k, times in split_gemms(gpt, b, tp, cp, cp_kind)}
    sbh = s * b * h / cp / (tp if sequence_parallel else 1)
    passes = 3 if gpt.gated_mlp else 2     # GeLU: read, write; SwiGLU: gate and up read
    mask = 1 if gpt.dropout else 0         # a dropout's mask, and its output's write
    streamed = 2 * 2 * sbh * e + 2 * (3 * e + mask) * sbh + \
        passes * s * b * f * e / (tp * cp) * mlp_copies(gpt)[1]
    scores = 0 if gpt.flash_attention else \
        (2 * e + mask * (e + 1)) * b * a * s * s / (tp * cp)
    core = gemms["scores"] + gemms["context"] + stream_seconds(scores, cluster)
    forward = sum(gemms.values()) + stream_seconds(streamed + scores, cluster)
    return {"forward": forward, "backward": 2 * forward, "selective": core}


def head_seconds(gpt, b, tp, cluster, e=2, cp=1):
    """(forward, backward) of the logit layer on b sequences split over tp ranks (tp = 1:
    whole) and its loss: the h x V/tp GEMM, the final norm, and the fp32 logits'
    softmax and cross-entropy (written, read, their gradient written); s / cp
    positions of each on one of cp context-parallel ranks."""
    s, h = gpt.seq_len // cp, gpt.d_model
    gemm = gemm_seconds(b * s, max(1, gpt.vocab // tp), h, cluster, e)
    streamed = stream_seconds(2 * b * s * h * e + 3 * 4 * b * s * gpt.vocab / tp, cluster)
    return gemm + streamed, 2 * gemm + streamed


def embedding_seconds(gpt, b, cluster, e=2, cp=1):
    """(forward, backward) of the word and position embeddings on b sequences (s / cp
    positions of each with cp): rows read and written; the backward adds the
    gradients' rows into the table's."""
    moved = stream_seconds(2 * 2 * b * gpt.seq_len * gpt.d_model * e / cp, cluster)
    return moved, 2 * moved
