"""The --compress spec, parsed: which compression, and its one number.

    spec = parse_compress("topk:0.01")      # CompressSpec(kind="topk", ratio=0.01)
    spec = parse_compress("powersgd:4")     # CompressSpec(kind="powersgd", rank=4)
    spec = parse_compress("fp16")           # CompressSpec(kind="fp16")

    spec        what travels                               file
    none        float32, all-reduced                       compression/casts.py
    fp16, bf16  a 16-bit cast, all-reduced                 compression/casts.py
    fp8         e4m3 with a scale per bucket, all-gathered  fp8.py
                and summed in float32
    topk:R      the largest R fraction of each bucket,     topk.py
                (index, value) pairs all-gathered
    powersgd:K  rank-K factors P, Q of each matrix,        powersgd.py
                all-reduced (vectors go dense)

Under --sync ps and hybrid each compression encodes the slices a push carries instead,
which the servers decode to float32 (psrv/protocol.py, sync/server_buckets.py).

topk, powersgd and fp8 drop part of the gradient on each step; error feedback
(error_feedback.py, on unless --no-error-feedback) keeps what was dropped and
adds it to the next step's gradient, so nothing is lost, only delayed.
--sparsity-warmup STEPS lets top-k keep more in the first steps (kept_ratio_at).

Torch-free on purpose: TrainConfig checks the spec on construction, and the
sweep tools read configs without paying for `import torch`.
"""
import math
from dataclasses import dataclass

from allreduce.theory import bytes_sent

from .choices import COMPRESSIONS, ConfigError, flag_of, setting_of

# the compressions that keep state between steps and need error feedback to converge
LOSSY_KINDS = ("topk", "powersgd", "fp8")


@dataclass(frozen=True)
class CompressSpec:
    kind: str = "none"            # none, fp16, bf16, fp8, topk, powersgd
    ratio: float = 1.0            # topk: the fraction of each bucket's entries sent
    rank: int = 0                 # powersgd: the rank of the factors

    @property
    def lossy(self):
        """Whether the compression drops information each step (topk, powersgd, fp8):
        these need the all-gather or factor exchange of an all-reduce sync, and error
        feedback."""
        return self.kind in LOSSY_KINDS


def parse_compress(text, flag="compress"):
    """'none' | 'fp16' | 'bf16' | 'fp8' | 'topk:RATIO' (0 < RATIO <= 1) | 'powersgd:RANK' (>= 1)
    -> CompressSpec; ConfigError naming `flag` and the reason otherwise."""
    text = str(text)
    kind, sep, number = text.partition(":")
    choices = f"{', '.join(COMPRESSIONS)}, topk:RATIO, powersgd:RANK"
    if not sep and kind in COMPRESSIONS:
        return CompressSpec(kind)
    if kind == "topk" and sep:
        try:
            ratio = float(number)
        except ValueError:
            ratio = None
        if ratio is None or not 0 < ratio <= 1:
            raise ConfigError(f"{flag}={text!r}: topk:RATIO needs 0 < RATIO <= 1 "
                              f"(e.g. topk:0.01 sends 1% of each bucket)", field="compress")
        return CompressSpec("topk", ratio=ratio)
    if kind == "powersgd" and sep:
        try:
            rank = int(number)
        except ValueError:
            rank = 0
        if rank < 1:
            raise ConfigError(f"{flag}={text!r}: powersgd:RANK needs an integer RANK >= 1 "
                              f"(e.g. powersgd:4)", field="compress")
        return CompressSpec("powersgd", rank=rank)
    raise ConfigError(f"{flag}={text!r} is not one of {choices}", field="compress")


def topk_count(n, ratio):
    """k: how many of a bucket's n entries are sent (at least one)."""
    return max(1, min(n, math.ceil(ratio * n)))


def kept_ratio_at(ratio, warmup, step):
    """The fraction of each bucket top-k sends at `step`, with --sparsity-warmup `warmup`.

    DGC's warm-up training (Lin et al., ICLR 2018, section 3.4): early gradients
    change fast and cutting them hard slows the start, so the sparsity rises
    exponentially, 75 %, 93.75 %, 98.4375 %, 99.6 %, 99.9 %, over the first epochs.
    The same stages here: stage i keeps 0.25 / 4^i, and the warm-up's `warmup`
    steps are cut into as many equal stages as quarterings lie between 25 % and
    RATIO (ceil(log4(0.25 / RATIO)): 4 for topk:0.001, the paper's 4 epochs of
    75 % .. 99.6 % before 99.9 %; 3 for topk:0.01).  Never below RATIO, exactly
    RATIO from step `warmup` on (and always with warmup 0, or RATIO >= 25 %).
    A function of the step only, so every rank picks the same k."""
    if step >= warmup or ratio >= 0.25:
        return ratio
    stages = math.ceil(math.log(0.25 / ratio, 4) - 1e-9)   # quarterings from 25 % to RATIO
    stage = step * stages // warmup
    return max(ratio, 0.25 / 4 ** stage)


def wire_bytes_sent(n, ratio, P, algo="ring"):
    """(top-k, float32) bytes one rank sends for a bucket of n float32 entries: the
    all-gather of P packs of 2k int32 against the all-reduce of 4n bytes."""
    k = topk_count(n, ratio)
    return bytes_sent(algo, "allgather", P * 2 * k * 4, P), bytes_sent(algo, "allreduce", 4 * n, P)


def check_compress(compress, sync, error_feedback=True, cli=True, sparsity_warmup=0):
    """The spec, and its combination with the sync, checked once for TrainConfig (cli:
    messages name --flags) and SyncOptions (keyword names); returns the CompressSpec."""
    spec = parse_compress(compress, "--compress" if cli else "compress")
    what = setting_of("compress", compress, cli)
    if isinstance(sparsity_warmup, bool) or not isinstance(sparsity_warmup, int) or \
            sparsity_warmup < 0:
        raise ConfigError(f"{flag_of('sparsity_warmup', cli)} must be a whole number of "
                          f"steps >= 0, got {sparsity_warmup!r}", field="sparsity_warmup")
    if sparsity_warmup and spec.kind != "topk":
        raise ConfigError(f"{setting_of('sparsity_warmup', sparsity_warmup, cli)} needs "
                          f"{setting_of('compress', 'topk:RATIO', cli)}, not {what}: the "
                          f"warm-up raises top-k's sparsity step by step", field="sparsity_warmup")
    if spec.kind != "none" and sync == "local":
        raise ConfigError(f"{what} with {setting_of('sync', 'local', cli)}: one process has "
                          f"no wire, so there is nothing to compress", field="sync")
    if not error_feedback and not spec.lossy:
        raise ConfigError(f"{'--no-error-feedback' if cli else 'error_feedback=False'} "
                          f"switches off the residuals of topk:RATIO, powersgd:RANK and fp8, "
                          f"not of {what}", field="error_feedback")
    return spec
