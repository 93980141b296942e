"""Fidelity figures of the grid: ZeRO memory and traffic, pipeline bubbles, ZeRO-3 speed,
and how much of the dp axis's communication backward hides.

    mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.bench_parallel --part zero
    mpiexec -n 2 .venv/bin/python -m mpi4py -m strategies.bench_parallel --part pipeline
    mpiexec -n 4 .venv/bin/python -m mpi4py -m strategies.bench_parallel --part overlap
    mpiexec -n 5 .venv/bin/python -m mpi4py -m strategies.bench_parallel --part servers
    mpiexec -n 4 ... --part zero      (N = 4; oversubscribed on two cores: figures of
                                       memory and bytes hold, times do not)

Every configuration is a full `strategies.train.train(argv)` in one launch (torch
is imported once), writing its JSON Lines into --out DIR; rank 0 reads the
records back and prints the tables (and appends them to --jsonl FILE as records).  Launch it
without TOPOLAB_CHECK=1: that mode adds a signature exchange to every collective,
which the byte counters would see.

zero:     MLP with Adam, in fp32 and in mixed precision (bf16, --precision).  Per
          rank, measured: params + grads + optimizer bytes against the ZeRO paper's
          formulas (memory.zero_memory: fp32 4+4+8, mixed 2+2+12 bytes a parameter); bytes
          sent per step against 2(N-1)/N * 4Ψ (stages 0-2; ring all-reduce, or
          reduce-scatter + all-gather) and 3(N-1)/N * 4Ψ (stage 3); median step
          time of ZeRO-3 over plain data parallelism, run interleaved
          (0 3 0 3 ...) because this VM's speed drifts minute by minute.
pipeline: MLP cut into 2 stages; the bubble of each rank = the share of the
          schedule's span spent in neither forward nor backward (trace.py),
          against bubble.py's (p-1)/(m+p-1), and (p-1)/(v m+p-1) for the
          interleaved schedule with v chunks a rank; and on stage 0 the peak of
          saved activations over one micro-batch's, GPipe against 1F1B.
overlap:  a dp2 x pp2 GPT (4 ranks) with ZeRO-1, its dp collectives inside the gradient
          hooks (--no-overlap: each one blocks backward, as the grid did before the comm
          thread) against on the comm thread (comm_thread.py), interleaved rounds; per
          configuration the median step time and the exposed-communication fraction
          (the trace's main-thread "comm" spans over the step).
servers:  the same grid without ZeRO through one parameter server (5 ranks): --sync ps
          and hybrid, interleaved rounds, each one's median step and exposed-communication
          fraction (the waits for the last buckets' round trips over the step).
"""
import argparse
import os
import statistics
import tempfile

from allreduce.cli import add_output_flags, out_dir
from allreduce.harness import interleaved
from allreduce.records import append_jsonl, provenance, read_jsonl
from allreduce.theory import zero_comm_bytes

from .parallel.bubble import bubble_fraction
from .runtime.memory import zero_memory

MLP = ["--model", "mlp", "--width", "512", "--depth", "4", "--in-dim", "512", "--classes", "16",
       "--dataset-size", "2048", "--global-batch", "64", "--threads", "1", "--no-progress",
       "--sync", "ring", "--optimizer", "adam", "--lr", "0.001"]
# The formula assumes equal stages: every hidden layer 1024 x 1024 (in-dim too), so the
# stages differ only by the head (1024 x 16) and stage 1's input gradient (1 matmul in 12).
PIPE = ["--model", "mlp", "--width", "1024", "--depth", "8", "--in-dim", "1024", "--classes", "16",
        "--dataset-size", "2048", "--global-batch", "256", "--threads", "1", "--no-progress",
        "--sync", "ring", "--lr", "0.01", "--pp", "2"]


def train(argv, path):
    from strategies.train import train
    train(argv + ["--jsonl", path])


def steps(path, skip=1):
    return [r for r in read_jsonl(path) if r["kind"] == "step" and r["step"] >= skip]


def zero_part(comm, directory, rounds, n_steps):
    N = comm.size

    def flags(stage):
        return ["--sync", "ring"] if stage == "plain" else ["--zero", str(stage), "--dp", str(N)]

    def path(stage, i):
        return os.path.join(directory, f"{stage}_{i}.jsonl")

    # Stages 1 and 2 once, for their memory and traffic, and every stage once in mixed
    # precision, for its memory; then interleaved rounds of whole training runs: 0, 3,
    # plain, 0, 3, plain ...  A sample is a step time the trainer records itself (setup
    # left out), read back by rank 0: the harness's own_clock.
    for stage in (1, 2):
        train(MLP + flags(stage) + ["--steps", str(n_steps)], path(stage, 0))
    for stage in range(4):
        train(MLP + flags(stage) + ["--precision", "bf16", "--steps", "2"],
              path(f"bf16_{stage}", 0))
    launches = {0: 0, 3: 0, "plain": 0}

    def launch(stage):
        i, launches[stage] = launches[stage], launches[stage] + 1
        train(MLP + flags(stage) + ["--steps", str(n_steps)], path(stage, i))
        return [r["step_time_s"] for r in steps(path(stage, i))] if comm.rank == 0 else []

    timed = interleaved({stage: (lambda stage=stage: launch(stage)) for stage in launches},
                        rounds=rounds, warmup=0, own_clock=True)
    if comm.rank:
        return []
    rows = []
    psi = steps(path(0, 0))[0]["memory"]["params"] / 4
    formula = {s: sum(zero_memory(psi, N, s, "fp32", "adam").values()) for s in range(4)}
    traffic = {s: zero_comm_bytes(psi, N, s) for s in range(4)}
    times = {**timed.samples, **{s: [r["step_time_s"] for r in steps(path(s, 0))] for s in (1, 2)}}
    for stage in range(4):
        records = steps(path(stage, 0))
        mem = records[-1]["memory"]
        state = mem["params"] + mem["grads"] + mem["optimizer"]
        sent = statistics.median(r["bytes_sent"] for r in records)
        rows.append({"kind": "zero", "stage": stage, "N": N, "psi": psi, "state_bytes": state,
                     "formula_bytes": formula[stage], "state_over_formula": state / formula[stage],
                     "precision": "fp32", "gathered_peak": mem["gathered_peak"],
                     "bytes_sent": sent,
                     "theory_bytes": traffic[stage], "sent_over_theory": sent / traffic[stage]})
    # Step k of round i of each configuration ran minutes apart from the others' at
    # most: Timings pairs them, and the ratio is the median over those pairs.
    for row in rows:
        row["median_step_s"] = statistics.median(times[row["stage"]])
        row["over_dp"] = row["median_step_s"] / timed.median(0) if row["stage"] in (1, 2) \
            else timed.ratio(row["stage"], 0)
        row["over_plain"] = row["median_step_s"] / timed.median("plain") \
            if row["stage"] in (1, 2) else timed.ratio(row["stage"], "plain")
    print(f"ZeRO, fp32 Adam, Ψ = {psi:,.0f} parameters, N = {N} "
          f"(plain = the data-parallel worker's bucketed, overlapped ring: "
          f"{1000 * timed.median('plain'):.1f} ms/step; ratios: the median over steps "
          f"run in the same round)")
    print(f"{'stage':>5} {'measured B':>12} {'formula B':>12} {'ratio':>6} {'sent B/step':>12} "
          f"{'theory B':>12} {'ratio':>6} {'gathered':>9} {'step ms':>8} {'/ stage 0':>9} "
          f"{'/ plain':>7}")
    for r in rows:
        print(f"{r['stage']:>5} {r['state_bytes']:>12,.0f} {r['formula_bytes']:>12,.0f} "
              f"{r['state_over_formula']:>6.3f} {r['bytes_sent']:>12,.0f} "
              f"{r['theory_bytes']:>12,.0f} "
              f"{r['sent_over_theory']:>6.3f} {r['gathered_peak']:>9,} "
              f"{1000 * r['median_step_s']:>8.1f} {r['over_dp']:>9.2f} {r['over_plain']:>7.2f}")
    return rows + mixed_rows(directory, psi, N)


def mixed_rows(directory, psi, N):
    """The ZeRO memory table again in mixed precision: 16-bit params and grads, the fp32
    master weights counted with Adam's state (the paper's K = 12)."""
    print(f"ZeRO, bf16 Adam (fp32 master weights), Ψ = {psi:,.0f}, N = {N}")
    print(f"{'stage':>5} {'params B':>10} {'grads B':>10} {'optim B':>10} {'measured B':>12} "
          f"{'formula B':>12} {'ratio':>6} {'fp32 form. B':>12} {'saved':>6}")
    rows = []
    for stage in range(4):
        mem = steps(os.path.join(directory, f"bf16_{stage}_0.jsonl"))[-1]["memory"]
        state = mem["params"] + mem["grads"] + mem["optimizer"]
        want = sum(zero_memory(psi, N, stage, "bf16", "adam").values())
        fp32 = sum(zero_memory(psi, N, stage, "fp32", "adam").values())
        rows.append({"kind": "zero", "stage": stage, "N": N, "psi": psi, "precision": "bf16",
                     "params": mem["params"], "grads": mem["grads"],
                     "optimizer": mem["optimizer"], "state_bytes": state,
                     "formula_bytes": want, "state_over_formula": state / want,
                     "fp32_formula_bytes": fp32})
        print(f"{stage:>5} {mem['params']:>10,} {mem['grads']:>10,} {mem['optimizer']:>10,} "
              f"{state:>12,} {want:>12,.0f} {state / want:>6.3f} {fp32:>12,.0f} "
              f"{1 - want / fp32:>6.0%}")
    return rows


def pipeline_part(comm, directory, n_steps):
    # (schedule, m, v): the interleaved schedule needs m a multiple of p, 8 layers % (p v)
    runs = [(s, m, 1) for m in (1, 4, 8) for s in ("gpipe", "1f1b")] + \
        [("interleaved", 4, 2), ("interleaved", 8, 2), ("interleaved", 8, 4)]
    for s, m, v in runs:
        train(PIPE + ["--schedule", s, "--micro-batches", str(m), "--virtual-stages", str(v),
                      "--steps", str(n_steps)], os.path.join(directory, f"{s}_{m}_{v}.jsonl"))
    if comm.rank:
        return []
    p = 2
    rows = []
    print(f"Pipeline, p = {p}: bubble = share of the schedule in neither forward nor backward")
    print(f"{'schedule':>11} {'m':>3} {'v':>2} {'bubble':>7} {'theory':>7} {'stage0':>7} "
          f"{'stage1':>7} {'act. live / one mb (stage 0)':>29}")
    for s, m, v in runs:
        records = steps(os.path.join(directory, f"{s}_{m}_{v}.jsonl"))
        per_stage = [statistics.median(r["bubble_fraction"] for r in records
                                       if r["coords"][1] == k) for k in range(p)]
        first = [r for r in records if r["coords"][1] == 0]
        live = max(r["memory"]["activations_peak"] / r["micro_batch_activation_bytes"]
                   for r in first)
        row = {"kind": "pipeline", "schedule": s, "m": m, "p": p, "v": v,
               "bubble": statistics.mean(per_stage), "theory": bubble_fraction(p, m, v),
               "per_stage": per_stage, "stage0_live_micro_batches": live,
               "stage0_peak_in_flight": max(r["peak_in_flight"] for r in first)}
        rows.append(row)
        print(f"{s:>11} {m:>3} {v:>2} {row['bubble']:>7.3f} {row['theory']:>7.3f} "
              f"{per_stage[0]:>7.3f} {per_stage[1]:>7.3f} {live:>29.2f}")
    return rows


GPT = ["--model", "gpt", "--layers", "4", "--d-model", "256", "--heads", "4", "--vocab", "64",
       "--seq-len", "64", "--dataset-size", "512", "--global-batch", "16", "--threads", "1",
       "--no-progress", "--sync", "ring", "--lr", "0.01", "--dp", "2", "--pp", "2",
       "--zero", "1", "--micro-batches", "2"]


def grid_rows(comm, directory, kind, configs, rounds, n_steps, baseline):
    """Each configuration (name -> its full flags) trained in interleaved rounds; on rank
    0 a row of each: the median step time (the slowest rank's, every step: every rank
    waits for it at the next step's collectives), the exposed-communication fraction,
    and the ratio to `baseline`'s step.  [] on the other ranks."""
    launches = dict.fromkeys(configs, 0)

    def path_of(name, i):
        return os.path.join(directory, f"{kind}_{name.replace(' ', '_')}_{i}.jsonl")

    def launch(name):
        i, launches[name] = launches[name], launches[name] + 1
        train(configs[name] + ["--steps", str(n_steps)], path_of(name, i))
        by_step = {}
        for r in (steps(path_of(name, i)) if comm.rank == 0 else []):
            by_step.setdefault(r["step"], []).append(r)
        return [max(rs, key=lambda r: r["step_time_s"]) for _, rs in sorted(by_step.items())]

    timed = interleaved({n: (lambda n=n: [r["step_time_s"] for r in launch(n)])
                         for n in configs}, rounds=rounds, warmup=0, own_clock=True)
    if comm.rank:
        return []
    rows = []
    for name in configs:
        records = [r for i in range(launches[name]) for r in steps(path_of(name, i))]
        exposed = statistics.median(r["comm_time_s"] / r["step_time_s"] for r in records)
        rows.append({"kind": kind, "config": name, "median_step_s": timed.median(name),
                     "exposed_fraction": exposed, "over_baseline": timed.ratio(name, baseline),
                     "baseline": baseline})
    return rows


def print_rows(rows, label, width):
    print(f"{label:>{width}} {'step ms':>8} {'exposed comm':>13} {'/ ' + rows[0]['baseline']:>12}")
    for row in rows:
        print(f"{row['config']:>{width}} {1000 * row['median_step_s']:>8.1f} "
              f"{row['exposed_fraction']:>13.1%} {row['over_baseline']:>12.2f}")


def overlap_part(comm, directory, rounds, n_steps):
    if comm.size != 4:
        raise SystemExit("--part overlap runs a dp2 x pp2 grid: launch it with mpiexec -n 4")
    rows = grid_rows(comm, directory, "overlap", {"in hook": GPT + ["--no-overlap"],
                                                  "comm thread": GPT},
                     rounds, n_steps, "in hook")
    if rows:
        print(f"dp2 x pp2 GPT, ZeRO-1, 2 micro-batches: the dp axis's collectives in the "
              f"hooks or on the comm thread ({rounds} interleaved rounds of {n_steps} steps)")
        print_rows(rows, "dp collectives", 14)
    return rows


def servers_part(comm, directory, rounds, n_steps):
    """The same dp2 x pp2 GPT (no ZeRO: the servers shard the state) through one
    parameter server: 4 workers and 1 server, --sync ps and hybrid.  The ring's row of
    the same grid is --part overlap's "comm thread" (with ZeRO-1, whose traffic is the
    all-reduce's): a launch of 4 ranks, since a run takes the whole world it is given."""
    if comm.size != 5:
        raise SystemExit("--part servers runs a dp2 x pp2 grid and a server: mpiexec -n 5")
    at = GPT.index("--zero")
    base = GPT[:at] + GPT[at + 2:] + ["--servers", "1"]
    rows = grid_rows(comm, directory, "servers", {
        "ps": base + ["--sync", "ps"],
        "hybrid": base + ["--sync", "hybrid", "--ranks-per-node", "2"]}, rounds, n_steps, "ps")
    if rows:
        print(f"dp2 x pp2 GPT, 2 micro-batches, through one server ({rounds} interleaved "
              f"rounds of {n_steps} steps); the ring's row: --part overlap, 'comm thread'")
        print_rows(rows, "sync", 8)
    return rows


def parser():
    p = argparse.ArgumentParser(prog="python -m strategies.bench_parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("zero", "pipeline", "overlap", "servers"),
                   required=True,
                   help="zero: memory, traffic and speed of the ZeRO stages; pipeline: "
                        "bubbles; overlap: the grid's dp collectives in the hooks or beside "
                        "backward; servers: the same grid through the parameter servers")
    add_output_flags(p, out_what="each configuration's training records (a temporary "
                                 "directory if not given)")
    p.add_argument("--rounds", type=int, default=3,
                   help="zero, overlap: interleaved rounds of the configurations")
    p.add_argument("--steps", type=int, default=8, help="training steps of every configuration")
    return p


def main(argv=None):
    from mpi4py import MPI
    args = parser().parse_args(argv)
    comm = MPI.COMM_WORLD
    directory = comm.bcast(out_dir(args.out) or tempfile.mkdtemp(prefix="bench_parallel_")
                           if comm.rank == 0 else None)
    if args.part == "zero":
        rows = zero_part(comm, directory, args.rounds, args.steps)
    elif args.part == "overlap":
        rows = overlap_part(comm, directory, args.rounds, args.steps)
    elif args.part == "servers":
        rows = servers_part(comm, directory, args.rounds, args.steps)
    else:
        rows = pipeline_part(comm, directory, args.steps)
    if comm.rank == 0 and args.jsonl:
        append_jsonl(args.jsonl, [{**r, **provenance()} for r in rows])


if __name__ == "__main__":
    main()
