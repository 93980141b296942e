"""Self-check of the pen-and-paper parts of labs 3, 4, 5, 7, 8 and 10: your numbers
against the formulas.

    .venv/bin/python -m experiments.labs.check_answers zero my_zero.toml
    .venv/bin/python -m experiments.labs.check_answers precision my_precision.toml
    .venv/bin/python -m experiments.labs.check_answers pipeline my_pipeline.toml
    .venv/bin/python -m experiments.labs.check_answers grid my_grid.py
    .venv/bin/python -m experiments.labs.check_answers compress my_compress.toml
    .venv/bin/python -m experiments.labs.check_answers context my_context.toml

Answer files (templates in the lab sheets):

    # my_zero.toml: bytes per rank of params + grads + optimizer state, fp32 Adam
    params = 1_000_000        # psi
    ranks = 4                 # N
    stage0 = 16_000_000       # a total, or a table of its parts:
    [stage1]                  #   params, grads, optimizer (then each part is graded)
    params = ...
    grads = ...
    optimizer = ...

    # my_precision.toml: the same in mixed precision (16-bit params and grads, fp32
    # master weights and Adam's moments), and SGD with momentum at stage 0
    params = 1_000_000
    ranks = 4
    stage0 = ...              # (a total, or [stageN] parts, as above)
    momentum_stage0 = ...

    # my_pipeline.toml
    stages = 4
    [bubble]                  # idle fraction for m micro-batches
    m1 = ...
    [in_flight_first_stage]   # micro-batches whose activations stage 0 holds at once
    gpipe_m8 = ...

    # my_grid.py: def coords_of(rank, dp, pp, tp) -> (d, p, t), tp varying fastest;
    #             group_of(rank, axis, dp, pp, tp), if you wrote it, is checked too

    # my_compress.toml: bytes one rank sends per step over a ring, top-k against float32
    params = 1_000_000        # n float32 gradients in one bucket
    ranks = 4                 # P
    ratio = 0.01              # topk:RATIO
    dense_bytes = ...         # the float32 ring all-reduce
    topk_bytes = ...          # the all-gather of int32 index + float32 value pairs
    break_even_ratio = ...    # the RATIO at which both send the same

    # my_context.toml: bytes one rank's attention cores send a step (cp_bytes), float32
    batch = 8                 # b: sequences a rank holds
    d_model = 64              # C
    layers = 2                # L
    [ring]                    # cpN_seqT: N context-parallel ranks, sequences of T tokens
    cp2_seq64 = ...
    [ulysses]
    cp2_seq64 = ...

Each answer within 1 % of the formula (experiments/costmodel.py holds them;
lab 8's is strategies/config/compress_spec.py's wire_bytes_sent, lab 10's
strategies/parallel/context_parallel.py's context_bytes)
is `ok`.  A wrong one is `WRONG` with your figure, never the expected one: the
check says which answer (and which part of it) to rework, not what it should be.
"""
import argparse
import itertools
import re
import sys
import tomllib

import numpy as np

from experiments import costmodel
from strategies.config.compress_spec import wire_bytes_sent
from strategies.parallel.context_parallel import context_bytes

from .grading import grade, load_student


def check_zero(a, precision="fp32"):
    psi, N = a["params"], a["ranks"]
    for stage in range(4):
        want = costmodel.zero_memory(psi, N, stage, precision)
        got = a.get(f"stage{stage}")
        if isinstance(got, dict):           # graded part by part
            for part in want:
                yield f"stage{stage}.{part}", got.get(part), want[part]
        else:
            yield f"stage{stage}", got, sum(want.values())


def check_precision(a):
    """Lab 7: ZeRO's stages in mixed precision, and how the optimizer changes K."""
    yield from check_zero(a, "bf16")
    want = costmodel.zero_memory(a["params"], a["ranks"], 0, "bf16", "momentum")
    yield "momentum_stage0", a.get("momentum_stage0"), sum(want.values())


def check_compress(a):
    """Lab 8: dense and top-k bytes a rank sends, and where top-k stops saving."""
    n, P, ratio = a["params"], a["ranks"], a["ratio"]
    topk, dense = wire_bytes_sent(n, ratio, P)
    yield "dense_bytes", a.get("dense_bytes"), dense
    yield "topk_bytes", a.get("topk_bytes"), topk
    yield "break_even_ratio", a.get("break_even_ratio"), 1 / P


def check_context(a):
    """Lab 10: what ring attention and Ulysses send a step, one rank, at each cp and T."""
    for kind in ("ring", "ulysses"):
        for key, got in a.get(kind, {}).items():
            found = re.fullmatch(r"cp(\d+)_seq(\d+)", key)
            if not found:
                raise SystemExit(f"[{kind}] {key}: name an answer cpN_seqT, as cp2_seq64")
            cp, seq = (int(n) for n in found.groups())
            yield f"{kind}.{key}", got, context_bytes(kind, a["batch"], seq, a["d_model"], cp,
                                                      a["layers"])


def check_pipeline(a):
    p = a["stages"]
    for key, got in a.get("bubble", {}).items():
        yield f"bubble.{key}", got, costmodel.bubble_fraction(p, int(key.lstrip("m")))
    for key, got in a.get("bubble_interleaved", {}).items():       # "v2_m8": v chunks a rank
        v, m = (int(part[1:]) for part in key.split("_"))
        yield f"bubble_interleaved.{key}", got, costmodel.bubble_fraction(p, m, v)
    for key, got in a.get("in_flight_first_stage", {}).items():
        schedule, m = key.split("_m")
        yield f"in_flight_first_stage.{key}", got, costmodel.pipeline_activations_in_flight(
            p, int(m), schedule)


def check_grid(path):
    """coords_of (and group_of, if written) against the layout the lab fixes:
    arange(world).reshape(dp, pp, tp).  A wrong coords_of names the wrong
    coordinates (d, p or t), not their values."""
    module = load_student(path, "student_grid")
    with_groups = has_group_of(module)
    for dp, pp, tp in itertools.product((1, 2, 3), (1, 2, 4), (1, 2)):
        grid = np.arange(dp * pp * tp).reshape(dp, pp, tp)
        for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
            rank = int(grid[d, p, t])
            got = attempt(module.coords_of, rank, dp, pp, tp)
            name = f"coords_of({rank}, dp={dp}, pp={pp}, tp={tp})"
            if isinstance(got, tuple) and len(got) == 3 and got != (d, p, t):
                wrong = [axis for axis, g, w in zip("dpt", got, (d, p, t)) if g != w]
                name += f" ({' and '.join(wrong)} wrong)"
            yield name, got, (d, p, t)
            if not with_groups:
                continue
            for axis, want in (("dp", grid[:, p, t]), ("pp", grid[d, :, t]), ("tp", grid[d, p, :])):
                got = attempt(module.group_of, rank, axis, dp, pp, tp)
                got = tuple(sorted(got)) if isinstance(got, tuple) else got
                yield f"group_of({rank}, {axis!r}, dp={dp}, pp={pp}, tp={tp})", got, \
                    tuple(sorted(int(w) for w in want))


def attempt(fn, *args):
    """fn(*args) as a tuple, or the exception it raised, as text."""
    try:
        out = fn(*args)
        return tuple(int(v) for v in out)
    except Exception as e:              # noqa: BLE001 - the student's code may raise anything
        return f"{type(e).__name__}: {e}"


def has_group_of(module):
    """Whether the student wrote group_of (the skeleton's raises NotImplementedError)."""
    if not hasattr(module, "group_of"):
        return False
    try:
        module.group_of(0, "tp", 1, 1, 1)
    except NotImplementedError:
        return False
    except Exception:                   # noqa: BLE001 - written, but wrong: check it
        return True
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.labs.check_answers",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lab", choices=("zero", "precision", "pipeline", "grid", "compress",
                                           "context"))
    ap.add_argument("file")
    a = ap.parse_args(argv)
    if a.lab == "grid":
        checks = check_grid(a.file)
    else:
        with open(a.file, "rb") as f:
            answers = tomllib.load(f)
        checks = {"zero": check_zero, "precision": check_precision,
                  "pipeline": check_pipeline, "compress": check_compress,
                  "context": check_context}[a.lab](answers)
    # grid: hundreds of checks, so only the first few wrong ones are listed
    shown = 8 if a.lab == "grid" else None
    wrong, total = grade(checks, shown)
    if a.lab == "grid":
        print(f"{total - wrong} of {total} right" + (f" (the first {shown} wrong ones above)"
                                                        if wrong > shown else ""))
    print("PASS" if not wrong else f"FAIL: {wrong} wrong")
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
