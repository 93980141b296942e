"""Which layers sit on which pipeline stage, and on which chunk of it: the planner's side
of the cut (what a step's price is made of lives in step.py, which asks here).

    stages = balanced_stages(gpt, layout, ends=(1.0, 1.0))  # BLOOM's 5, 6 x 10, 5 (70 on 12)
    stages_of(gpt, layout)                        # the layout's own, else the even split
    kinds_of_stage(stages)                        # [first, fullest between, last]: priced
    stage_chunks(stages, s, v)                    # [layers of each of stage s's v chunks]
    max_chunks(stages)                            # the most chunks v a rank may hold
    chunk_share(stages, s, v)                     # its heaviest chunk's share of its work
    held_layers(chunks, forwards, p)              # layers' activations held at a moment

A stage holds the layers stage_layers (strategies/parallel/stages.py, the trainer's
rule too) gives it, the first stage the embedding too and the last the logit
layer; the embedding's and the head's work, in layers' worth (`ends`, priced by
step.ends_worth), weigh the balanced split and the interleaved schedule's uneven
chunks.  Under the interleaved schedule (Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", SC21, section 2.2.2) a
stage is cut into v chunks of one layer at least, and the heaviest chunk of the
pipeline paces every slot.  The first and the last stage may hold one chunk more,
of the embedding alone or of the head and the loss alone: Llama 3 405B's cut ("The
Llama 3 Herd of Models", 2024, section 3.3.2: one layer fewer on the first and the
last stage, so that "the first model chunk on the first stage has only the
embedding, and the last model chunk on the last stage has only output projection
and loss calculation"; 7, 8 x 14, 7 layers, 8 chunks a rank), and Megatron-LM's
with --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split, which count each as a layer in the cut.
"""
from strategies.parallel.stages import stage_layers


def stages_of(gpt, lo):
    """The layers of each of the layout's stages: its own, else the even split."""
    return list(lo.stages) if lo.stages else stage_layers(gpt.layers, lo.pp)


def balanced_stages(gpt, lo, ends=(0.0, 0.0), given=None):
    """The layout's stages: `given`, or stage_layers's balanced split with the
    embedding's and the head's work `ends` = (first, last) counted in layers' worth
    (step.ends_worth prices them for a layout on a cluster)."""
    if given is not None or lo.pp == 1:
        return tuple(stage_layers(gpt.layers, lo.pp, given=given))
    return tuple(stage_layers(gpt.layers, lo.pp, *ends))


def kinds_of_stage(stages):
    """The stages worth pricing: the first, the last, and between them the earliest of
    the fullest (it holds the most micro-batches of the most layers)."""
    inner = range(1, len(stages) - 1)
    fullest = [max(inner, key=lambda i: (stages[i], -i))] if len(stages) > 2 else []
    return sorted({0, len(stages) - 1, *fullest})


def stage_chunks(stages, stage, v, ends=(0.0, 0.0)):
    """[layers of each of the v chunks of `stage`] under the interleaved schedule: the
    even cut where v divides the stage's layers (Megatron-LM's, and the trainer's),
    else stage_layers's balanced split of them over v chunks, the embedding's worth on
    the first stage's first chunk and the head's on the last stage's last (the model's
    first and last virtual stage), ends: (first, last) in layers' worth (step.ends_worth).
    Each chunk holds one layer at least, but for one chunk more on the first and the
    last stage (max_chunks): [0, 1, ..., 1], the embedding alone, on the first, and
    [1, ..., 1, 0], the head and the loss alone, on the last."""
    n = stages[stage]
    if n % v == 0:
        return [n // v] * v
    if v == n + 1 and stage == 0:
        return [0] + [1] * n
    if v == n + 1 and stage == len(stages) - 1:
        return [1] * n + [0]
    first = ends[0] if stage == 0 else 0.0
    last = ends[1] if stage == len(stages) - 1 else 0.0
    return stage_layers(n, v, first, last)


def max_chunks(stages):
    """The most chunks v every rank can be cut into (each rank holds v): a layer a
    chunk, and on the first and the last stage one chunk more, of the embedding alone
    or of the head and the loss alone (the module docstring: Llama 3's cut).  Llama 3
    405B's 7, 8 x 14, 7 takes 8, where a layer a chunk alone allows 7."""
    ends = {0, len(stages) - 1}
    return min(n + (i in ends) for i, n in enumerate(stages))


def chunk_share(stages, stage, v, ends=(0.0, 0.0)):
    """The share of a micro-batch's work on `stage` in its heaviest chunk: 1 / v for an
    even cut without the ends, more where the chunks are uneven.

    Narayanan et al. (SC21, section 2.2.2) price the interleaved schedule with v equal
    chunks a rank: a slot is t / v, the fill and drain p - 1 slots, the bubble
    (p - 1) / (v m) of the compute.  With uneven chunks (a stage of 7 layers cut in
    4 is 2, 2, 2, 1) every chunk still passes each micro-batch on to the next rank
    in turn, so the heaviest chunk of the pipeline paces every slot: the step is
    (v m + p - 1) slots of it, and a rank whose chunks are lighter idles for the
    difference, which is bubble too.  With the stages of Llama 3 405B (7, 8 x 14, 7)
    and v = 4 the heaviest chunk is 2 layers, a quarter of the 8-layer stages: as fast
    as the even cut, where no v but 1 divides both 7 and 8; with v = 8 a chunk is a
    layer, the embedding's and the head's chunks lighter."""
    chunks = stage_chunks(stages, stage, v, ends)
    if v == 1:
        return 1.0
    first = ends[0] if stage == 0 else 0.0
    last = ends[1] if stage == len(stages) - 1 else 0.0
    worth = list(chunks)
    worth[0] += first
    worth[-1] += last
    return max(worth) / (sum(chunks) + first + last)


def held_layers(chunks, forwards, p):
    """Layers' activations a rank holds after `forwards` chunk-forwards of the
    interleaved schedule (activations_in_flight's count, times v), its chunks of
    `chunks` layers: Megatron-LM's order runs p micro-batches through chunk 0, the
    same p through chunk 1, ..., then the next p from chunk 0 (interleaved.py), so
    uneven chunks weigh as often as they come up."""
    v = len(chunks)
    rounds, rest = divmod(forwards, p * v)
    groups, single = divmod(rest, p)
    return p * (rounds * sum(chunks) + sum(chunks[:groups])) + \
        single * (chunks[groups] if groups < v else 0)
