"""Sequence parallelism (strategies/parallel/sequence_parallel.py): equal to one process, less memory.

Equivalence: `--tp 2 --sequence-parallel` (alone, with micro-batches, ZeRO-1 and
ZeRO-3, over the tree backend) and `--tp 3 --sequence-parallel` train the same
model on the same global batch as `--sync local` on one process, k = 3 steps.
Tolerance rtol = 1e-5, atol = 1e-6, as in tests/test_parallel_runs.py and for the
same reason: only the order of float additions changes (here also the sums of
the LayerNorm gradients over the sequence shards); measured differences are
<= 3e-8, while leaving out that sum moves the LayerNorm weights by ~1e-3.

A pipeline cut (pp = 2 x tp = 2 needs four processes) is checked on two ranks by
tests/mpi/sequence_parallel_stages.py, in the same launch as the tp = 2 runs.

Memory and traffic are measured in that launch too: the activation peak falls by
exactly the formula's bytes (the meter counts the storages autograd saves, and
every other saved tensor is the same with and without the flag; bound: 1 % of the
saving), and each rank sends exactly the bytes of `tp_bytes_sent` (ring; the
launch runs without TOPOLAB_CHECK, whose argument checks send messages of their own).
"""
import pytest

from strategies.config.choices import ConfigError
from strategies.config.settings import TrainConfig, parse_args
from strategies.parallel.sequence_parallel import saved_bytes_saving, tp_bytes_sent
from test_parallel_runs import GPT, assert_same_run, launch

SP = ["--tp", "2", "--sequence-parallel"]
# tp = 3 (odd on purpose): 3 heads, 6 positions, 2 per rank
GPT3 = ["--model", "gpt", "--layers", "2", "--d-model", "12", "--heads", "3", "--vocab", "12",
        "--seq-len", "6", "--dataset-size", "120", "--global-batch", "6", "--lr", "0.05",
        "--momentum", "0.9"]
TWO = [
    ("tp2", GPT + ["--tp", "2"]),
    ("sp", GPT + SP),
    ("sp_micro", GPT + SP + ["--micro-batches", "2"]),
    ("sp_zero1", GPT + SP + ["--zero", "1"]),
    ("sp_zero3", GPT + SP + ["--zero", "3", "--micro-batches", "2"]),
    ("sp_tree", GPT + SP + ["--sync", "tree"]),
]
STAGES = "\nimport runpy\nrunpy.run_path('tests/mpi/sequence_parallel_stages.py', " \
         "run_name='__main__')\n"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("sp_reference"), 1,
                  [("gpt", GPT + ["--sync", "local"]), ("gpt3", GPT3 + ["--sync", "local"])])


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """The tp = 2 runs, then the pipeline-cut check, in one launch of two ranks."""
    return launch(tmp_path_factory.mktemp("sp_two"), 2, TWO, timeout=300, then=STAGES,
                  expect="sequence-parallel stages: 29 gradients equal", TOPOLAB_CHECK=0)


def test_flags_that_do_not_fit_are_config_errors():
    with pytest.raises(ConfigError, match=r"--sequence-parallel .* needs --tp > 1, got --tp 1"):
        TrainConfig(model="gpt", sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"--seq-len 8 is not divisible by tp\(3\): 8 % 3 = 2"):
        TrainConfig(sync="ring", model="gpt", d_model=12, heads=3, seq_len=8, tp=3,
                    sequence_parallel=True)
    cfg = parse_args(["--sync", "ring", "--model", "gpt", "--tp", "2", "--sequence-parallel"])
    assert cfg.sequence_parallel and not parse_args([]).sequence_parallel


def test_saving_formula_by_hand():
    """b = 8, s = 8, h = 16, L = 2, t = 2: per block 4 bsh + 4 bs = 4352 floats, ln_f
    bsh + 2 bs = 1152; half of (2 x 4352 + 1152) floats of 4 bytes = 19712."""
    assert saved_bytes_saving(8, 8, 16, 2, 2, True) == 19712
    assert saved_bytes_saving(8, 8, 16, 1, 2, False) == 0
    # tensor parallel: 2 blocks x 4 all-reduces of 4096 bytes, each sending half of it twice
    assert tp_bytes_sent(8, 8, 16, 2, 2, True, True, False) == 2 * 4 * 4096


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [n for n, _ in TWO])
def test_two_tp_ranks_reproduce_one_process(two, reference, name):
    assert_same_run(two[name], reference["gpt"], 2)


@pytest.mark.timeout(400)
def test_activation_memory_falls_by_the_layer_norm_share(two):
    """Global batch 8, one micro-batch, one stage: every rank's peak of saved activations
    is the tensor-parallel run's less saved_bytes_saving (bound: 1 % of the saving)."""
    want = saved_bytes_saving(8, 8, 16, 2, 2, True)
    tp_peak = {r["rank"]: r["memory"]["activations_peak"] for r in two["tp2"][0]}
    for r in two["sp"][0]:
        saving = tp_peak[r["rank"]] - r["memory"]["activations_peak"]
        assert saving == pytest.approx(want, rel=0.01), (r["rank"], r["step"], saving, want)


@pytest.mark.timeout(400)
def test_tp_traffic_matches_the_count(two):
    """Per step and rank: one micro-batch of 8, or two of 4 (the replicated weights'
    gradients are summed once per micro-batch)."""
    for name, micro, runs in (("tp2", 8, 1), ("sp", 8, 1), ("sp_micro", 4, 2)):
        want = runs * tp_bytes_sent(micro, 8, 16, 2, 2, True, True, name != "tp2")
        for r in two[name][0]:
            assert r["bytes_sent"] == want, (name, r["rank"], r["bytes_sent"], want)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_three_tp_ranks_reproduce_one_process(tmp_path, reference):
    runs = launch(tmp_path, 3, [("sp3", GPT3 + ["--tp", "3", "--sequence-parallel"])])
    assert_same_run(runs["sp3"], reference["gpt3"], 3)
