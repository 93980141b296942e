"""The splits of a model over ranks, each on its own textbook page.

    tensor_parallel.py    Megatron's f and g, column/row-parallel linears, split heads
    sequence_parallel.py  LayerNorms and residuals on T/tp positions (--sequence-parallel)
    stages.py             how many blocks each pipeline stage holds: the balanced split, or by
                          hand (--pp-layers); the planner's rule too
    pipeline.py           stages of blocks; GPipe and 1F1B over the point-to-point transport
    interleaved.py        interleaved 1F1B: v chunks of layers a rank (--virtual-stages)
    expert_parallel.py    experts over the ep ranks, tokens moved by all-to-alls
    context_order.py      which positions a cp rank holds: contiguous or zig-zag (--cp-order)
    ring_attention.py     context parallelism: k, v blocks round the cp ring, online softmax
    ulysses.py            context parallelism: all-to-alls from a sequence to a head split
    recompute.py          each block's forward re-run in backward (activation checkpointing)
    bubble.py             the pipeline formulas: bubble fractions, activations in flight

Each takes a model (model/) and the mesh's communicators (config/mesh.py) and changes
the model in place or wraps it; the data parallelism over what is left, plain or
sharded (ZeRO) or through the parameter servers, is sync/'s; the one step engine
(engine/loop.py) drives the result.
"""
