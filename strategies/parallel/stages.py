"""How many transformer layers each pipeline stage holds: the one rule, for the trainer
(pipeline.py's cut) and the planner (experiments/planner) alike.

    stage_layers(70, 12)                          # [6, ..., 6, 5, 5]: the layers alone
    stage_layers(70, 12, first=1, last=1)         # [5, 6, ..., 6, 5]: BLOOM-176B's split
    stage_layers(126, 16, given=(7,) + (8,) * 14 + (7,))   # by hand (Llama 3 405B's)

A stage's work is its layers plus what sits on it besides: the embedding on the
first stage, the logit layer (the head) and the loss on the last, each counted in
layers' worth (`first`, `last`; the planner passes their predicted time over a
layer's, the trainer their FLOPs over a layer's: pipeline.py's `stage_sizes`).  The pipeline runs at the pace of its slowest stage, so the balanced
split is the one whose heaviest stage is lightest:

    minimise  max_i (n_i + extra_i)   over n_i >= 1 whole layers, sum n_i = layers

Every stage holds at least one layer, so any pp <= layers has a split.  The
split is found exactly: for a bound T, stage i can take floor(T - extra_i)
layers, so T is feasible when those add up to the layers; the least feasible T
is some whole number plus one of the extras, found by bisection for each extra.
Where T leaves room for more layers than there are, the surplus comes off the
heaviest stages, the last first; with no extras and pp dividing the layers this
is the even split of Megatron-LM and GPipe.

The same choice elsewhere: Megatron-LM's --decoder-first-pipeline-num-layers and
--decoder-last-pipeline-num-layers (the ends by hand, the rest even), DeepSpeed's
PipelineModule(partition_method="type:transformer|embedding") (the embedding
counted as a layer on each end: BLOOM's 5, 6 x 10, 5 for 70 layers on 12 stages).
"""
import math

# The longest pipeline considered: sixteen times Megatron-LM's longest published one
# (64 stages, the 1-trillion-parameter GPT of Narayanan et al. 2021); it keeps a
# split's list short whatever the layers and the GPUs.
MAX_STAGES = 1024


def _check(layers, pp):
    if not (isinstance(layers, int) and isinstance(pp, int)) or \
            not 1 <= pp <= min(layers, MAX_STAGES):
        raise ValueError(f"pp={pp} stages need 1 <= pp <= layers ({layers}), every stage "
                         f"holding at least one layer, and pp <= {MAX_STAGES}")


def _capacity(bound, extras):
    """Layers the stages take when none may weigh more than `bound` (None: under 1 each)."""
    taken = [math.floor(bound - e + 1e-9) for e in extras]
    return None if min(taken) < 1 else sum(taken)


def stage_layers(layers, pp, first=0.0, last=0.0, given=None):
    """[layers of stage 0, ..., of stage pp - 1]: `given` checked, or the balanced split
    when the first stage carries `first` layers' worth of other work and the last
    `last` (both on one stage when pp = 1)."""
    _check(layers, pp)
    if given is not None:
        given = list(given)
        if len(given) != pp or min(given) < 1 or sum(given) != layers:
            raise ValueError(f"--pp-layers {','.join(map(str, given))}: needs {pp} stages "
                             f"of at least one layer adding up to {layers} layers, got "
                             f"{len(given)} adding up to {sum(given)}")
        return given
    if not (math.isfinite(first) and math.isfinite(last) and first >= 0 and last >= 0):
        raise ValueError(f"a stage's other work must be finite and >= 0, got first={first}, "
                         f"last={last}")
    extras = [0.0] * pp
    extras[0] += first
    extras[-1] += last
    # 1. the least bound T whose capacity reaches the layers: a whole number plus an extra
    best = math.inf
    for e in set(extras):
        # hi: every stage may take all the layers, the heaviest end's besides: feasible
        lo, hi = 1, layers + 1 + math.ceil(max(extras))
        while lo < hi:
            mid = (lo + hi) // 2
            took = _capacity(mid + e, extras)
            if took is not None and took >= layers:
                hi = mid
            else:
                lo = mid + 1
        best = min(best, lo + e)
    # 2. every stage as full as T allows, the surplus off the heaviest, the last first
    counts = [math.floor(best - e + 1e-9) for e in extras]
    surplus = sum(counts) - layers
    while surplus:
        heaviest = max((i for i in range(pp) if counts[i] > 1),
                       key=lambda i: (counts[i] + extras[i], i))
        counts[heaviest] -= 1
        surplus -= 1
    return counts
