"""Today's GPT shapes in the trainer (strategies/model/models.py) and their tp split
(strategies/parallel/tensor_parallel.py); the pipeline's uneven stages
(strategies/parallel/pipeline.py).

Tier (a): parameter shapes, the flags' errors, the stages' split.  Tier (b): each
shape against an independent reference: grouped-query attention equals multi-head
attention whose key and value heads are copied for every query head of their group;
SwiGLU equals down(silu(x W1) * (x W3)) written out; the block split over 2 tp ranks
(two threads, an all-reduce between them) gives the whole block's output, and its
gradients reassembled are the whole block's.  Tolerance 1e-6 absolute: float32 sums
in another order.
"""
import copy
import threading

import pytest
import torch
import torch.nn.functional as F

from strategies.config.choices import ConfigError
from strategies.config.settings import TrainConfig, check_world, parameter_count
from strategies.model.models import GPT, Block, CausalSelfAttention
from strategies.parallel.interleaved import chunk_layers
from strategies.parallel.pipeline import stage_layers, stage_sizes
from strategies.parallel.tensor_parallel import TensorParallel, parallelize_blocks
from strategies.runtime.checkpoint import layout_of

ATOL = 1e-6


def test_shapes_of_the_matrices():
    block = Block(d_model=16, heads=4, kv_heads=2, ffn_hidden=24, gated_mlp=True)
    shapes = {name: tuple(p.shape) for name, p in block.named_parameters()}
    # qkv: 16 query features over 2 heads of 4 for keys and for values: 16 + 2 x 8
    assert shapes["attn.qkv.weight"] == (32, 16)
    assert shapes["mlp.0.weight"] == (48, 16)              # W1 over W3: 2 x 24
    assert shapes["mlp.2.weight"] == (16, 24)              # W2
    plain = Block(d_model=16, heads=4)                     # GPT-2's shape, names unchanged
    assert {n: tuple(p.shape) for n, p in plain.named_parameters()}["mlp.0.weight"] == (64, 16)
    assert [n for n, _ in plain.named_parameters()] == list(shapes)


@pytest.mark.parametrize("kw", [dict(), dict(kv_heads=1), dict(kv_heads=2, ffn_hidden=40),
                                dict(kv_heads=2, ffn_hidden=24, gated_mlp=True)])
def test_parameter_count_is_the_model_s(kw):
    cfg = TrainConfig(model="gpt", layers=3, d_model=16, heads=4, vocab=12, seq_len=8, **kw)
    model = GPT(12, 8, 3, 16, 4, cfg.kv_heads or None, cfg.ffn_hidden or None, cfg.gated_mlp)
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters())


def test_grouped_query_attention_is_attention_with_shared_heads():
    """4 query heads over 2 key-value heads = 4-head attention whose key and value heads
    1 and 2 copy heads 0 and 1 of the grouped one (query head i reads i // 2)."""
    torch.manual_seed(1)
    gqa = CausalSelfAttention(16, heads=4, kv_heads=2)
    mha = CausalSelfAttention(16, heads=4)
    width = 4
    w, b = gqa.qkv.weight.detach(), gqa.qkv.bias.detach()
    heads_of = [i // 2 for i in range(4)]                  # kv head of each query head

    def copied(t, start):                                  # rows of kv heads, per query head
        return torch.cat([t[start + h * width:start + (h + 1) * width] for h in heads_of])

    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat([w[:16], copied(w, 16), copied(w, 24)]))
        mha.qkv.bias.copy_(torch.cat([b[:16], copied(b, 16), copied(b, 24)]))
        mha.proj.load_state_dict(gqa.proj.state_dict())
    x = torch.randn(3, 5, 16) + 10 * torch.arange(5.0)[:, None]   # position-dependent
    torch.testing.assert_close(gqa(x), mha(x), atol=ATOL, rtol=0)


def test_gated_mlp_is_swiglu_written_out():
    torch.manual_seed(2)
    mlp = Block(8, 2, ffn_hidden=6, gated_mlp=True).mlp
    x = torch.randn(2, 3, 8)
    fc, out = mlp[0], mlp[2]
    w1, w3 = fc.weight[:6], fc.weight[6:]
    b1, b3 = fc.bias[:6], fc.bias[6:]
    want = F.linear(F.silu(F.linear(x, w1, b1)) * F.linear(x, w3, b3), out.weight, out.bias)
    torch.testing.assert_close(mlp(x), want, atol=ATOL, rtol=0)


class ThreadRing:
    """The tp collective of `size` threads in one process: each deposits its tensor,
    all read the sum (the same order of additions on every rank)."""

    def __init__(self, size):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def of(self, rank):
        ring = self

        class Rank:
            def allreduce(self, x, op="sum"):
                ring.slots[rank] = x.clone()
                ring.barrier.wait()
                total = sum(ring.slots[1:], ring.slots[0].clone())
                ring.barrier.wait()             # everyone has read before the next deposit
                return total
        return Rank()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kw", [dict(kv_heads=2, ffn_hidden=24, gated_mlp=True),
                                dict(kv_heads=2), dict(gated_mlp=True)])
def test_block_split_over_two_tp_ranks_is_the_whole_block(kw):
    torch.manual_seed(3)
    whole = Block(16, 4, **kw)
    blocks = [copy.deepcopy(whole) for _ in range(2)]      # built here, not in the threads
    x = torch.randn(2, 6, 16) + torch.arange(6.0)[:, None]
    whole(x).square().sum().backward()
    ring, results = ThreadRing(2), {}

    def rank_main(rank):
        block = blocks[rank]
        tp = TensorParallel(ring.of(rank), rank, 2)
        parallelize_blocks([block], tp)
        y = block(x)
        y.square().sum().backward()
        results[rank] = (y.detach(), tp, dict(block.named_parameters()))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wanted = dict(whole.named_parameters())
    for rank in range(2):
        y, tp, params = results[rank]
        torch.testing.assert_close(y, whole(x).detach(), atol=ATOL, rtol=0)
        for name, p in params.items():
            pieces, shape = tp.pieces.get(id(p), (None, None))
            if pieces is None:                  # whole on every tp rank
                torch.testing.assert_close(p.grad, wanted[name].grad, atol=1e-5, rtol=1e-5)
                continue
            for full_index, local_index in pieces:
                torch.testing.assert_close(p.grad[local_index], wanted[name].grad[full_index],
                                           atol=1e-5, rtol=1e-5, msg=name)


def test_flags_of_today_shapes_are_checked():
    gpt = dict(model="gpt", layers=4, d_model=16, heads=4, global_batch=8, sync="ring")
    with pytest.raises(ConfigError, match=r"--kv-heads 3 does not divide --heads 4"):
        TrainConfig(**gpt, kv_heads=3)
    with pytest.raises(ConfigError, match=r"--kv-heads 2 is not divisible by tp\(4\)"):
        check_world(TrainConfig(**{**gpt, "heads": 8}, kv_heads=2, tp=4), 4)
    with pytest.raises(ConfigError, match=r"--ffn-hidden 30 is not divisible by tp\(4\)"):
        check_world(TrainConfig(**gpt, ffn_hidden=30, tp=4), 4)
    with pytest.raises(ConfigError, match="--model moe's experts"):
        TrainConfig(**{**gpt, "model": "moe"}, gated_mlp=True)
    assert check_world(TrainConfig(**{**gpt, "heads": 8}, kv_heads=4, tp=4, ffn_hidden=40), 4)


def test_pipeline_flags_are_checked():
    gpt = dict(model="gpt", layers=7, d_model=16, heads=4, global_batch=8, sync="ring")
    check_world(TrainConfig(**gpt, pp=3), 3)               # 7 % 3 != 0: uneven is fine
    for split, message in (("2,3", "needs 3 stages"), ("2,0,5", "at least one block"),
                           ("2,3,3", "adds up to 8 blocks, the model has --layers 7"),
                           ("2;3;2", "not blocks per stage between commas")):
        with pytest.raises(ConfigError, match=message):
            TrainConfig(**gpt, pp=3, pp_layers=split)
    with pytest.raises(ConfigError, match="interleaved is not supported: its pp x v chunks "
                                          "are cut evenly"):
        TrainConfig(**{**gpt, "layers": 8}, pp=2, schedule="interleaved", virtual_stages=2,
                    pp_layers="3,5")
    assert TrainConfig(**gpt, pp=3, pp_layers="2,3,2").stage_split == (2, 3, 2)


def test_balanced_stages_weigh_the_embedding_and_the_head():
    gpt = GPT(vocab=12, seq_len=8, layers=7, d_model=16, heads=4, kv_heads=2,
              ffn_hidden=24, gated_mlp=True)
    assert stage_sizes(gpt, 3) == [2, 3, 2]
    assert stage_sizes(GPT(12, 8, 8, 16, 4), 4) == [2, 2, 2, 2]     # even where it divides
    # a head of 50,000 words weighs some 12 blocks: its stage keeps one block
    assert stage_sizes(GPT(50000, 16, 12, 64, 4), 4)[-1] == 1
    assert stage_sizes(gpt, 3, given=(3, 2, 2)) == [3, 2, 2]
    names = [[n for n, _ in stage_layers(gpt, s, 3, [3, 2, 2])] for s in range(3)]
    assert names == [["embed", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "blocks.4"],
                     ["blocks.5", "blocks.6", "head"]]
    # one chunk a rank is the stage of the split; interleaved chunks stay even
    assert [n for n, _ in chunk_layers(gpt, 1, 3, 1, (3, 2, 2))[0]] == ["blocks.3", "blocks.4"]


def test_the_checkpoint_layout_names_the_split(tmp_path):
    gpt = dict(model="gpt", layers=7, d_model=16, heads=4, global_batch=8, sync="ring", pp=3)
    assert layout_of(TrainConfig(**gpt, pp_layers="2,3,2"))["pp_layers"] == "2,3,2"
    assert layout_of(TrainConfig(**gpt, pp_layers="2,3,2")) != \
        layout_of(TrainConfig(**gpt, pp_layers="3,2,2"))
    # a lossy compressor's state is each rank's own, of that compression; a cast keeps
    # none, so its layout is the plain run's (one written before compress was a key)
    casts = [layout_of(TrainConfig(**gpt, compress=c)) for c in ("none", "fp16", "bf16")]
    assert casts[0] == casts[1] == casts[2] and "compress" not in casts[0]
    assert layout_of(TrainConfig(**gpt, compress="topk:0.01"))["compress"] == "topk:0.01"
    # a file that names its cast reads as one that does not
    from strategies.runtime.checkpoint import FORMAT, digest, load
    for compress, want in (("fp16", {"pp": 3}), ("topk:0.01", {"pp": 3, "compress": "topk:0.01"})):
        state = {"format": FORMAT, "step": 2, "layout": {"pp": 3, "compress": compress}}
        state["digest"] = digest(state)
        torch.save(state, tmp_path / "checkpoint.pt")
        assert load(str(tmp_path / "checkpoint.pt"))["layout"] == want
