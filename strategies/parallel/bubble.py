"""The pipeline formulas, in one home: the bubble and the activations a stage holds.

The tests, strategies/bench_parallel.py (measured against these), the cost model
(experiments/costmodel.py) and the labs' answer checker all import them from here.

With p stages, m micro-batches and a forward plus backward of one micro-batch
taking t on one stage, a step of GPipe or 1F1B lasts (m + p - 1) t, of which
each stage computes m t: the bubble is (p - 1) t, a fraction

    GPipe, 1F1B:   (p - 1) / (m + p - 1)            (Huang et al. 2019, section 2.2)

The interleaved schedule (Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", SC 2021, section 2.2.2) gives
each rank v chunks of 1/v of its layers: a slot lasts t / v, the fill and drain
still take p - 1 slots, and the step computes v m of them, so

    interleaved:   (p - 1) / (v m + p - 1)

The paper writes (p - 1) / (v m): the bubble's time over the compute time
(bubble-to-compute), not its share of the step; the two agree when v m >> p.
"""


def _check(p, m, v):
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p >= 1 stages, m >= 1 micro-batches and v >= 1 chunks, "
                         f"got p={p}, m={m}, v={v}")


def bubble_fraction(p, m, v=1):
    """The idle share of a step: (p - 1) / (v m + p - 1); v = 1 for GPipe and 1F1B."""
    _check(p, m, v)
    return (p - 1) / (v * m + p - 1)


def bubble_to_compute(p, m, v=1):
    """The paper's bubble time over ideal compute time: (p - 1) / (v m)."""
    _check(p, m, v)
    return (p - 1) / (v * m)


def activations_in_flight(p, m, schedule, stage=0, v=1):
    """Micro-batches of this stage's whole share of layers whose activations `stage` holds
    at once.  GPipe: all m.  1F1B: at most p - stage (Narayanan et al. 2021, section 2.2).
    Interleaved: the warm-up's 2 (p - stage - 1) + (v - 1) p chunk-forwards and one more
    (interleaved.py), each of 1/v of the layers: a little more than 1F1B."""
    _check(p, m, v)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - stage)
    if schedule == "interleaved":
        return min(v * m, 2 * (p - stage - 1) + (v - 1) * p + 1) / v
    raise ValueError(f"schedule must be gpipe, 1f1b or interleaved, got {schedule!r}")
