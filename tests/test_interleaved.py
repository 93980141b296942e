"""The interleaved 1F1B schedule (strategies/parallel/interleaved.py): tiers (a) and (c).

(a) No processes: each rank's order runs every (chunk, micro-batch) forward once and
its backward once after it; a simulation of the sends and blocking receives (equal
op times, free messages) finishes on every rank, never deadlocks, respects every
dependency, and leaves bubble.py's (p-1)/(v m+p-1) idle; the docstring's step table
is that simulation's; the chunk cut covers the model once; the flags' ConfigErrors.

(c) mpiexec: --pp 2 --virtual-stages 2 --micro-batches 4 (GPT and MLP), and on four
ranks dp 2 x pp 2 with ZeRO-3 and pp 2 x tp 2 sequence-parallel with ZeRO-1, end
allclose to one process after 3 steps with tests/test_parallel_runs.py's
tolerance, rtol = 1e-5, atol = 1e-6: the split only
reorders float additions (the micro-batch gradients' sum), a few ulps; a chunk on
the wrong rank or a micro-batch counted twice moves values by ~1e-3.
"""
import json
import re

import pytest
from test_parallel_runs import assert_same_run, launch

from strategies.parallel import interleaved
from strategies.parallel.bubble import activations_in_flight, bubble_fraction, bubble_to_compute
from strategies.config.choices import ConfigError
from strategies.config.settings import TrainConfig
from strategies.parallel.interleaved import chunk_layers, interleaved_order
from strategies.model.models import GPT, MLP
from strategies.config.validate import check_world

CASES = [(2, 2, 2), (2, 2, 4), (2, 3, 4), (2, 4, 8), (3, 2, 6), (4, 2, 4), (4, 2, 8),
         (4, 3, 8)]


def simulate(p, v, m):
    """Run every rank's order: an op starts when its rank is free and the message it
    receives was sent (sends never block: isend).  {(op, global stage, mb): (rank,
    start, end)}; fails on a deadlock (no rank can go on)."""
    orders = [interleaved_order(s, p, v, m) for s in range(p)]
    last = p * v - 1
    done, clock, pos = {}, [0] * p, [0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            op, c, i = orders[s][pos[s]]
            g = c * p + s
            needs = [("F", g, i)] if op == "B" else []       # its own forward first
            if op == "F" and g > 0:
                needs.append(("F", g - 1, i))                # the activation from g - 1
            if op == "B" and g < last:
                needs.append(("B", g + 1, i))                # the gradient from g + 1
            if not all(n in done for n in needs):
                continue                                     # a blocking receive waits
            start = max([clock[s]] + [done[n][2] for n in needs])
            done[op, g, i] = (s, start, start + 1)
            clock[s], pos[s], moved = start + 1, pos[s] + 1, True
        assert moved, f"deadlock at p={p}, v={v}, m={m}: positions {pos}"
    return done


@pytest.mark.timeout(30)
@pytest.mark.parametrize("p, v, m", CASES)
def test_every_rank_runs_each_chunk_and_micro_batch_once(p, v, m):
    for s in range(p):
        ops = interleaved_order(s, p, v, m)
        pairs = [(c, i) for c in range(v) for i in range(m)]
        assert sorted(ops) == sorted([("B", c, i) for c, i in pairs] +
                                     [("F", c, i) for c, i in pairs])
        assert all(ops.index(("F", c, i)) < ops.index(("B", c, i)) for c, i in pairs)
        in_flight = peak = 0
        for op, _, _ in ops:
            in_flight += 1 if op == "F" else -1
            peak = max(peak, in_flight)
        assert peak == activations_in_flight(p, m, "interleaved", s, v) * v


@pytest.mark.timeout(30)
@pytest.mark.parametrize("p, v, m", CASES)
def test_simulated_schedule_has_no_deadlock_and_the_formulas_bubble(p, v, m):
    done = simulate(p, v, m)
    assert len(done) == 2 * p * v * m
    for (op, g, i), (rank, start, _) in done.items():
        assert rank == g % p                                 # chunk g // p of rank g % p
        if op == "F" and g > 0:
            assert done["F", g - 1, i][2] <= start
        if op == "B":
            assert done["F", g, i][2] <= start
            if g < p * v - 1:
                assert done["B", g + 1, i][2] <= start
    span = max(end for _, _, end in done.values())
    busy = 2 * v * m                                         # slots each rank computes
    assert 1 - busy / span == pytest.approx(bubble_fraction(p, m, v))
    assert (span - busy) / busy == pytest.approx(bubble_to_compute(p, m, v))


@pytest.mark.timeout(30)
def test_docstring_step_table_is_the_simulation():
    rows = re.findall(r"rank (\d): (.*)", interleaved.__doc__)
    drawn = {(int(r), k): cell for r, line in rows for k, cell in enumerate(line.split())}
    done = simulate(2, 2, 4)
    want = {(rank, start): f"{op}{i}.{g // 2}" for (op, g, i), (rank, start, _) in done.items()}
    assert {k: cell for k, cell in drawn.items() if cell != "."} == want


@pytest.mark.timeout(30)
def test_bubble_formulas():
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(2, 4, 2) == pytest.approx(1 / 9)
    assert bubble_to_compute(4, 8, 2) == pytest.approx(3 / 16)
    assert activations_in_flight(4, 8, "interleaved", 0, 2) == pytest.approx(11 / 2)
    with pytest.raises(ValueError):
        bubble_fraction(2, 4, 0)


@pytest.mark.timeout(30)
def test_chunks_cover_the_model_once_in_global_stage_order():
    gpt = GPT(vocab=8, seq_len=4, layers=4, d_model=8, heads=2)
    names = [[[n for n, _ in chunk] for chunk in chunk_layers(gpt, s, 2, 2)] for s in range(2)]
    assert names == [[["embed", "blocks.0"], ["blocks.2"]],
                     [["blocks.1"], ["blocks.3", "head"]]]
    mlp = MLP(4, 8, 4, 3)
    chunks = [chunk for s in range(2) for chunk in chunk_layers(mlp, s, 2, 2)]
    params = [p for chunk in chunks for _, layer in chunk for p in layer.parameters()]
    assert sorted(map(id, params)) == sorted(id(p) for p in mlp.parameters())


def cfg(**kw):
    base = dict(model="gpt", layers=4, d_model=16, heads=4, global_batch=8, sync="ring",
                pp=2, schedule="interleaved", virtual_stages=2, micro_batches=4)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kw, message", [
    (dict(schedule="1f1b"), "--virtual-stages 2 needs --schedule interleaved, not "
                            "--schedule 1f1b"),
    (dict(virtual_stages=1), "--schedule interleaved needs --virtual-stages >= 2"),
    (dict(pp=1), "needs a pipeline: --pp >= 2, got --pp 1"),
    (dict(virtual_stages=0), "--virtual-stages must be >= 1"),
])
def test_flag_errors(kw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg(**kw)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kw, message", [
    (dict(micro_batches=3), "--micro-batches 3 is not a multiple of pp(2)"),
    (dict(layers=6), "--layers 6 is not divisible by pp(2) x virtual stages(2) = 4"),
    (dict(model="mlp", depth=2), "--depth 2 is not divisible by pp(2) x virtual stages(2)"),
])
def test_grid_errors(kw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_world(cfg(**kw), 2)


GPT4 = ["--model", "gpt", "--layers", "4", "--d-model", "16", "--heads", "2", "--vocab", "12",
        "--seq-len", "8", "--dataset-size", "120", "--global-batch", "8", "--lr", "0.05",
        "--momentum", "0.9"]
MLP4 = ["--model", "mlp", "--width", "24", "--depth", "4", "--in-dim", "8", "--classes", "4",
        "--dataset-size", "120", "--global-batch", "16", "--lr", "0.05", "--momentum", "0.9"]
INTERLEAVED = ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("reference"), 1,
                  [("gpt", GPT4 + ["--sync", "local"]), ("mlp", MLP4 + ["--sync", "local"])])


@pytest.mark.timeout(300)
def test_two_ranks_reproduce_one_process(tmp_path, reference):
    trace = tmp_path / "trace.json"
    runs = launch(tmp_path, 2, [
        ("gpt", GPT4 + INTERLEAVED + ["--micro-batches", "4", "--trace", str(trace)]),
        ("mlp", MLP4 + INTERLEAVED + ["--micro-batches", "4"])])
    for name in ("gpt", "mlp"):
        assert_same_run(runs[name], reference[name], 2)
    # each rank ran 2 chunks x 4 micro-batches forward and backward a step, and saw a bubble
    events = json.load(open(trace))["traceEvents"]
    for pid in (0, 1):
        forwards = {e["name"] for e in events if e.get("cat") == "forward" and e["pid"] == pid}
        assert forwards == {f"forward mb{i} chunk{c}" for i in range(4) for c in range(2)}
    records, _ = runs["gpt"]
    assert all(0 < r["bubble_fraction"] < 1 for r in records)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_ranks_with_dp_tp_and_zero_reproduce_one_process(tmp_path, reference):
    runs = launch(tmp_path, 4, [
        ("dp2_zero3", GPT4 + INTERLEAVED + ["--dp", "2", "--zero", "3", "--micro-batches", "2"]),
        ("tp2_sp_zero1", GPT4 + INTERLEAVED + ["--tp", "2", "--sequence-parallel", "--zero", "1",
                                               "--micro-batches", "2"])],
        timeout=250)
    for name in ("dp2_zero3", "tp2_sp_zero1"):
        assert_same_run(runs[name], reference["gpt"], 4)



@pytest.mark.timeout(60)
def test_gantt_panel_names_chunks_and_uses_the_interleaved_formula(tmp_path):
    from experiments import training_plots
    events = [{"name": f"{'forward' if op == 'F' else 'backward'} mb{i} chunk{g // 2}",
               "cat": "forward" if op == "F" else "backward", "ph": "X", "pid": rank,
               "ts": 1000.0 * start, "dur": 1000.0}
              for (op, g, i), (rank, start, _) in simulate(2, 2, 4).items()]
    assert training_plots.pipeline_gantt({"interleaved, m=4, v=2": events}, str(tmp_path))
    (panel,) = json.load(open(tmp_path / "pipeline_gantt.json"))
    assert panel["left_title"] == "bubble 11% measured, 11% by (p-1)/(vm+p-1)"
    assert sorted(panel["texts"]) == sorted(f"{i}.{c}" for i in range(4) for c in range(2)
                                            for _ in range(4))      # F and B on 2 ranks
