"""Which techniques go together: every sync x model x pair of techniques, asked of the validator.

    python -m strategies.compatibility            # the Markdown page docs/compatibility.md
    python -m strategies.compatibility --check    # exit 1 if docs/compatibility.md is stale
    python -m strategies.compatibility --write    # rewrite it

The product is every --sync (local, the all-reduces, ps, hybrid, and torch under
torchrun as a launcher of its own) x every model (gpt, mlp, moe) x every technique and
pair of techniques.  Each combination is handed to TrainConfig and to the launcher's
check (config/validate.py's check_flags and check_launcher): they are the one judge,
and a refusal is listed with the ConfigError's own words, which say why.  A refusal
is either of a combination with no meaning (ZeRO over parameter servers, which
already shard the state; a split of one process) or of one not built; the page says
which by the reason's words.  The page is generated, never written by hand, so it
cannot disagree with the code; tests/test_compatibility.py checks that it is today's
and runs a sample of the accepted combinations for real.

Checks that need the world size (divisibility of batches, layers and heads) are
not combinations of techniques and are left out: they are check_world's.
"""
import argparse
import sys
from functools import lru_cache
from itertools import combinations
from pathlib import Path

from .config.choices import ALLREDUCE_SYNCS, SYNCS, ConfigError
from .config.settings import TrainConfig
from .config.validate import check_launcher

TORCHRUN = "torchrun"              # --sync torch, launched by torchrun (no MPI)
LAUNCHES = tuple(s for s in SYNCS if s != "local") + ("local", TORCHRUN)
MODELS = ("gpt", "mlp", "moe")
# (the flags as a user types them, the TrainConfig fields they set)
TECHNIQUES = [
    ("--zero 1", {"zero": 1}),
    ("--zero 3", {"zero": 3}),
    ("--pp 2", {"pp": 2, "micro_batches": 2}),
    ("--schedule interleaved", {"pp": 2, "micro_batches": 2, "schedule": "interleaved",
                                "virtual_stages": 2}),
    ("--tp 2", {"tp": 2}),
    ("--sequence-parallel", {"tp": 2, "sequence_parallel": True}),
    ("--ep 2", {"ep": 2}),
    ("--cp 2", {"cp": 2}),
    ("--grad-accum 2", {"grad_accum": 2}),
    ("--recompute", {"recompute": True}),
    ("--precision bf16", {"precision": "bf16"}),
    ("--precision fp16", {"precision": "fp16"}),
    ("--reduce-precision fp32", {"reduce_precision": "fp32"}),
    ("--compress fp16", {"compress": "fp16"}),
    ("--compress topk:0.01", {"compress": "topk:0.01"}),
    ("--compress powersgd:2", {"compress": "powersgd:2"}),
    ("--compress fp8", {"compress": "fp8"}),
    ("--checkpoint-dir", {"checkpoint_dir": "ckpt"}),
    ("--straggler 0:0.1", {"straggler": "0:0.1"}),
    ("--device cuda", {"device": "cuda"}),
    ("--no-overlap", {"overlap": False}),
]


FIELDS = dict(TECHNIQUES)


def fields_of(launch, model, *names):
    """TrainConfig's fields for a launch (a --sync, or torchrun), a model and techniques."""
    out = {"sync": "torch" if launch == TORCHRUN else launch, "model": model}
    for name in names:
        out.update(FIELDS[name])
    return out


@lru_cache(maxsize=None)
def refusal(launch, model, *names):
    """The ConfigError's message for this combination (techniques by name), or None
    where it is taken."""
    try:
        cfg = TrainConfig(**fields_of(launch, model, *names))
        check_launcher(cfg, torchrun=launch == TORCHRUN)
    except ConfigError as e:
        return str(e)
    return None


def judged():
    """[(launch, model, technique or "", technique or "", why or None)]: the launch with
    the model alone, each technique alone where that is taken, and each pair of
    techniques taken alone."""
    out = []
    for launch in LAUNCHES:
        for model in MODELS:
            out.append((launch, model, "", "", refusal(launch, model)))
            if out[-1][-1]:
                continue
            alone = {name: refusal(launch, model, name) for name in FIELDS}
            out += [(launch, model, name, "", why) for name, why in alone.items()]
            out += [(launch, model, a, b, refusal(launch, model, a, b))
                    for a, b in combinations(FIELDS, 2) if not alone[a] and not alone[b]]
    return out


def accepted():
    """[(launch, model, technique or "", technique or "")] the validator takes."""
    return [row[:4] for row in judged() if row[4] is None]


def table():
    """[(launches, technique, technique or "", models, why)]: the refusals, those that
    differ only in the launch or the model as one row."""
    by_reason = {}
    for launch, model, a, b, why in judged():
        if why:
            by_reason.setdefault((a, b, why), {}).setdefault(launch, []).append(model)
    rows = []
    for (a, b, why), where in by_reason.items():
        by_models = {}
        for launch, models in where.items():
            by_models.setdefault(tuple(models), []).append(launch)
        rows += [(launches, a, b, models, why) for models, launches in by_models.items()]
    return rows


def launches_named(launches):
    if len(launches) == len(LAUNCHES):
        return "any"
    if set(launches) == set(ALLREDUCE_SYNCS) | {TORCHRUN}:     # torchrun's is --sync torch
        return "every all-reduce"
    return ", ".join("torchrun" if x == TORCHRUN else f"`{x}`" for x in launches)


def markdown(rows=None):
    rows = table() if rows is None else rows
    tried = len(judged())
    lines = [
        "# What goes with what",
        "",
        f"Every launch ({len(LAUNCHES)}: each `--sync`, and `--sync torch` under torchrun, "
        f"one of \"every all-reduce\") "
        f"x every model ({', '.join(MODELS)}) x each of the {len(TECHNIQUES)} techniques "
        f"below and each pair of them: {tried} combinations judged, {len(accepted())} "
        f"taken, {len(rows)} rows of refusals. Generated by "
        f"`python -m strategies.compatibility --write`; each reason is the validator's own "
        f"words, and tests/test_compatibility.py holds this page to the code and runs a "
        f"sample of what it takes.",
        "",
        "A refusal is of a combination with no meaning (ZeRO over the parameter servers, "
        "which already shard the state; a split of one process; a technique of another "
        "model), or of one not built, whose reason says what is missing. A pair is judged "
        "where both of its techniques are taken alone.",
        "",
        "| --sync | technique | with | model | refused because |",
        "|---|---|---|---|---|"]
    for launches, a, b, models, why in rows:
        on = "any" if len(models) == len(MODELS) else ", ".join(models)
        lines.append(f"| {launches_named(launches)} | {f'`{a}`' if a else '(alone)'} | "
                     f"{f'`{b}`' if b else ''} | {on} | {why.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


DOC = Path(__file__).resolve().parent.parent / "docs" / "compatibility.md"


def documented(path=DOC):
    return path.read_text()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m strategies.compatibility",
                                description="Which combinations the validator refuses.")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if docs/compatibility.md is not today's")
    p.add_argument("--write", action="store_true", help="rewrite docs/compatibility.md")
    args = p.parse_args(argv)
    text = markdown()
    if args.write:
        DOC.write_text(text)
        return 0
    if args.check:
        if documented() != text:
            print("docs/compatibility.md is stale: run "
                  "`python -m strategies.compatibility --write`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
