"""FP8 frames with a scale per bucket and error feedback (strategies/compression/fp8.py).

Tier (a): quantise/dequantise within e4m3's rounding bound, the packing round trip,
and error feedback's promise (what was sent plus the residual is what came in) with
a one-rank stand-in for the all-gather.  Tier (c): 30 steps of a small MLP on 2
ranks (tests/mpi/fp8_training.py): the loss within 3 % of float32's, the bytes a
quarter of float32's (n + 4 against 4n per bucket; measured 6928 against 27688).
"""
import json

import pytest
import torch

from conftest import check_ok, mpirun
from strategies.compression.fp8 import (E4M3_MAX, Fp8Compressor, dequantise, pack, quantise,
                                        unpack)


class OneRank:
    size, rank = 1, 0

    def allgather(self, x, n=None):
        return x.clone()


def values(n=1001):
    """Magnitudes over eight decades, both signs, position-dependent, never all-ones."""
    i = torch.arange(n, dtype=torch.float32)
    return torch.sin(i * 0.7) * 10.0 ** (i % 8 - 5)


def test_amax_lands_on_the_largest_e4m3_value_and_the_rest_round_within_a_sixteenth():
    x = values()
    q, scale = quantise(x)
    amax = x.abs().max()
    assert scale == pytest.approx(E4M3_MAX / amax.item())
    assert q.float().abs().max() == E4M3_MAX
    # e4m3 keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself; below
    # the smallest normal (2^-6, scaled) the spacing is 2^-9, so half of it absolute
    err = (dequantise(q, scale) - x).abs()
    bound = torch.maximum(x.abs() / 16, torch.full_like(x, 2 ** -10) / scale)
    assert (err <= bound * (1 + 1e-6)).all(), (err - bound).max()


def test_a_zero_bucket_has_scale_one_and_stays_zero():
    q, scale = quantise(torch.zeros(5))
    assert scale == 1 and (dequantise(q, scale) == 0).all()


def test_a_tiny_bucket_keeps_a_finite_scale_and_its_values():
    # 448 / 1e-38 passes float32's largest: the scale stops there (runtime/fp8_formats.py),
    # finite and positive (a server refuses any other), and q / s is x within e4m3's
    # rounding, no inf or NaN
    x = torch.tensor([1e-38, -5e-39, 0.0])
    q, scale = quantise(x)
    assert torch.isfinite(scale) and scale > 0
    torch.testing.assert_close(dequantise(q, scale), x, rtol=1 / 16, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_a_bucket_with_an_inf_or_a_nan_has_scale_one_and_keeps_it_not_finite(bad):
    # Transformer Engine's rule: a scale of 1 where amax is not finite, so the finite
    # entries come back as they went (1, 2, 4 are e4m3 values) and the bad one stays
    # not finite (NaN: e4m3fn has no inf), for fp16's vote to see; the wire takes the
    # scale (the servers refuse one that is not finite and positive)
    from strategies.runtime.fp8_formats import E5M2, quantize, scale_of
    x = torch.tensor([1.0, 2.0, bad, -4.0])
    q, scale = quantise(x)
    assert scale == 1
    out = dequantise(q, scale)
    assert out[[0, 1, 3]].tolist() == [1.0, 2.0, -4.0] and out[2].isnan()
    assert scale_of(torch.tensor(bad), E5M2) == 1
    assert not torch.isfinite(dequantise(*quantize(x, E5M2))[2])


@pytest.mark.parametrize("n", [1, 4, 7, 1001])
def test_the_packed_message_round_trips(n):
    q, scale = quantise(values(n))
    message = pack(q, scale)
    assert message.dtype == torch.int32 and message.numel() == -(-n // 4) + 1
    q2, scale2 = unpack(message, n)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and scale2 == scale


def test_error_feedback_keeps_what_rounding_dropped():
    fp8 = Fp8Compressor(OneRank())
    grads = [values() * (1 + step) + step for step in range(4)]
    sent = torch.zeros(1001)
    for g in grads:
        flat = g.clone()
        handed = fp8.reduce_bucket(0, flat, None, None, None)
        sent += flat
        assert handed == (-(-1001 // 4) + 1) * 4          # n + 4 bytes, padded to words
    torch.testing.assert_close(sent + fp8.feedback.residual(0), sum(grads),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_fp8_trains_as_float32_does_with_a_quarter_of_the_bytes():
    # about 4 s here.  Without TOPOLAB_CHECK: its signature exchange before each collective
    # travels on the same transport and would add to the bytes counted
    result = check_ok(mpirun(2, ["tests/mpi/fp8_training.py"], timeout=140, TOPOLAB_CHECK=0))
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    fp32, fp8 = runs["fp32"], runs["fp8"]
    assert abs(fp8["loss"] - fp32["loss"]) <= 0.03 * fp32["loss"], runs
    assert fp8["handed_per_step"] / fp32["handed_per_step"] == pytest.approx(0.25, rel=0.01)
    # on 2 ranks the all-gather sends (P-1)(n+4), the ring all-reduce 2 (P-1)/P 4n
    assert fp8["sent_per_step"] / fp32["sent_per_step"] == pytest.approx(0.25, rel=0.01)


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_the_trainer_takes_compress_fp8_on_the_ring(tmp_path):
    """`strategies.train --compress fp8` at P = 2 on the ring, 30 steps against float32
    from the same weights and data: the final loss within 3 % of float32's, and the
    gradient bytes handed to the collectives (the records' wire_bytes) a quarter of
    float32's, up to the 4-byte scale and the padding per bucket."""
    common = ["--sync", "ring", "--model", "mlp", "--width", "64", "--depth", "2",
              "--steps", "30", "--lr", "0.2", "--bucket-mb", "1", "--threads", "1",
              "--no-progress"]
    runs = {name: tmp_path / f"{name}.jsonl" for name in ("none", "fp8")}
    argvs = [common + ["--compress", name, "--jsonl", str(path)] for name, path in runs.items()]
    several = ["-c", "import json, sys\nfrom strategies.train import main\n"
                     "for argv in json.loads(sys.argv[1]):\n    main(argv)"]
    check_ok(mpirun(2, several + [json.dumps(argvs)], timeout=140))
    summary = {name: [json.loads(line) for line in open(path)][-1] for name, path in runs.items()}
    dense, fp8 = summary["none"], summary["fp8"]
    assert abs(fp8["final_loss"] - dense["final_loss"]) <= 0.03 * dense["final_loss"], summary
    assert fp8["wire_ratio"] == pytest.approx(0.25, rel=0.01), fp8["wire_ratio"]
