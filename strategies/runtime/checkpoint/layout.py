"""What a file must share with the run that reads it: the run's layout, and the
coordinates of the rank that wrote it.

The layout is what each rank's share depends on: the degrees, the blocks of each
pipeline stage (a stage's file numbers its layers from its own first, so a run cut
3, 2, 2 must not read a set cut 2, 3, 2) and a lossy --compress (topk's residuals are
no warm start of PowerSGD, and a run with another compression would not be the run
that never stopped).  A run resumes in its own layout: another one is refused in one
line naming what differs, on both sides, in either layout of the files (paths.py).

The coordinates are the writing rank's place in the run (rank, dp, pp, tp, cp, expert
group and ep rank, ZeRO shard): a file that holds another rank's share says so
(sets.py checks them against the manifest).
"""
from ...config.choices import ConfigError
from ...config.compress_spec import parse_compress

# what a run must share with the run it resumes: each rank's file holds its share
# (pp_layers: the blocks of each stage, which the trainer writes into its config;
# compress: a lossy compressor's state is each rank's own, of that compression; the
# casts keep none, layout_of leaves them out)
LAYOUT = ("dp", "pp", "tp", "ep", "zero", "virtual_stages", "sequence_parallel", "pp_layers",
          "cp", "compress")
# left out of a layout where they hold their default, so that a set written before
# they existed keeps its layout
UNSET = {"cp": 1, "compress": "none"}


def layout_of(cfg):
    """The settings a run's shares depend on; cp only where it is set (UNSET), compress
    only where it is lossy (the test sharded() makes): a cast (fp16, bf16) keeps no
    state, so a run may resume under another cast or none, and a layout without the key
    is a run without a lossy compressor, written before or after the key existed."""
    layout = {k: getattr(cfg, k) for k in LAYOUT if getattr(cfg, k) != UNSET.get(k, ())}
    return without_casts(layout)


def without_casts(layout):
    """`layout` without a compress that keeps no state (a cast): what layout_of writes,
    and how a stored layout is read, whoever wrote it (a set may name its cast)."""
    if "compress" in layout and not parse_compress(layout["compress"]).lossy:
        layout = {k: v for k, v in layout.items() if k != "compress"}
    return layout


def differing(layout, other):
    """`layout`'s settings that `other` does not share, in LAYOUT's order, for a message:
    "pp 1, tp 2" (an unset one, such as a whole model's pp_layers, left out; cp and
    compress named by their default where `other` sets them)."""
    def value(of, k):
        return of.get(k, UNSET.get(k))
    return ", ".join(f"{k} {value(layout, k)}" for k in LAYOUT
                     if value(layout, k) not in (value(other, k), None, ""))


def another_layout(cfg, where, layout):
    """The ConfigError of --resume from `where` (a file or a set), written by a run of
    `layout`, which is not this run's: one line naming what differs on both sides.  A
    split set and checkpoint.pt differ in their layout too (a lossy --compress, or a
    split model, writes a file a rank; sharded)."""
    ours = layout_of(cfg)
    return ConfigError(f"--resume: {where} was written by a run of "
                       f"{differing(layout, ours) or 'the same layout'}; this run is "
                       f"{differing(ours, layout) or 'the same layout'} (a run resumes in its "
                       f"own layout)", field="resume")


def coordinates(cfg, ctx):
    """This rank's place in the run: what its file must say to be its file."""
    place = {"rank": ctx.rank}
    mesh = ctx.mesh
    if mesh is not None:
        place.update(dp=mesh.dp_rank, pp=mesh.pp_rank, tp=mesh.tp_rank)
        if cfg.cp > 1:
            place["cp"] = mesh.cp_rank
        if cfg.ep > 1:
            place.update(expert_group=mesh.expert_group, ep=mesh.ep_rank)
        if cfg.zero:
            place["zero_shard"] = mesh.dp_cp.rank    # ZeRO shards over the dp x cp replicas
    return place


def describe_place(place):
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in place.items())
