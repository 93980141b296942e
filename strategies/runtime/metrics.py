"""Per-step, per-rank records as JSON Lines, a progress bar, and the end-of-run summary:
the one record writer of strategies.train, for the plain loop and the grid alike.

Record kinds in --jsonl FILE (appended by the first training rank only), each with the
run's `run_id`, so that several runs can share a file:
    {"kind": "config", ...the resolved TrainConfig..., "world_size", "dp_size", "pp_size",
     "tp_size", "host", "start_step"}
    {"kind": "step", "step", "rank", "loss", "local_loss", "step_time_s", "compute_time_s",
     "comm_time_s", "ended_s", "bytes_sent", "bytes_received", "peak_mem_mb", ...}   per rank
        every run: "staleness", "comm_rounds" (this step's collectives or server round
        trips);  the grid (a pipeline): "coords" [dp, pp, tp], "idle_time_s",
        "bubble_fraction", "peak_in_flight", "micro_batch_activation_bytes", "memory"
        --precision fp16: "loss_scale", "overflow_skips" (so far; the summary has the total)
        --ep: "alltoall_time_s", "alltoall_bytes" (sent by this rank), "dropped_fraction"
        --cp: "cp_bytes", "cp_time_s" (the attention cores' traffic and waits), "cp_rank"
        all-reduce syncs: "wire_bytes" (gradient bytes this rank handed to the collectives,
        after --compress), "dense_bytes" (the same as float32 all-reduces); topk:
        "kept_ratio" (the fraction of each bucket sent: RATIO, more during --sparsity-warmup)
    {"kind": "summary", ...}
The file is appended to, as every tool's --jsonl is.  With --resume the run goes on
under the checkpoint's run id, and that run's step records at or after the
checkpoint's step are dropped (forget_steps_from); other runs' records stay.

`loss` is the loss of the whole global batch: the mean of the local losses of
the ranks that compute one (every data-parallel rank; on the grid the first
tensor-parallel rank of each last pipeline stage; with --cp each cp rank, over its
equal slice of the positions), each a mean over B/P samples, so it equals the
one-process loss on B samples and runs of any P compare directly.  `comm_time_s`
is the *exposed* communication: the time the main thread was blocked waiting for
the sync after backward (communication hidden behind backward is not in it); on a
GPU, the time its stream waited for the gradients after backward's kernels (CUDA
events: StepClock, below).
`bytes_*` are this step's traffic of this rank.

`ended_s` is when this rank ended the step, in seconds from the run's start on its
own clock: every wait (for a server, a peer, a checkpoint) included, which the step
times leave out where the wait falls between steps, but not the metrics' own flushes.
Those come every step where the run is synchronous and only at checkpoints under
SSP and ASP, so counting them would slow BSP's clock against the others by the
records' own cost, not by its consistency (lab 2 compares the three on this clock).

Records are gathered to every training rank with one small collective, which
every worker waits in, at most --timeout seconds (waits.py: the rank that never
came is named).  Synchronous runs flush every step (the bar shows the
global loss at once); ASP/SSP flush only at checkpoints and at the end, so that
the metrics do not hold fast workers back to a slow one's pace.
"""
import resource
import time

import torch

from allreduce.records import append_jsonl, read_jsonl, rewrite_jsonl
from allreduce.units import format_size

from . import waits


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


class Metrics:
    """traffic: () -> (bytes sent, bytes received) of this rank so far, None where not
    observable; layout: {"world_size", "dp_size", "pp_size", "tp_size"} of the run."""

    def __init__(self, cfg, ctx, device, traffic, start_step, run_id, layout):
        self.cfg, self.control, self.device, self.traffic = cfg, ctx.workers, device, traffic
        self.rank, self.run_id, self.layout = ctx.rank, run_id, layout
        self.is_writer = self.control.rank == 0
        # asynchronous: at checkpoints (a resumed run keeps every record before its
        # step) and at the end; 0: at the end only
        self.flush_every = 1 if cfg.synchronous else cfg.checkpoint_every
        self._start = time.perf_counter()          # the ranks just met (the run id)
        self._flushed = 0.0                        # seconds spent in flush() so far
        self.pending, self.steps = [], []
        self.wire = []                             # per step: (wire, dense) bytes, all ranks
        self.overflow_skips = None                 # fp16: steps skipped so far (precision.py)
        self._bytes = traffic()                    # setup's broadcast is not a step
        self.file = cfg.jsonl if self.is_writer else ""
        self.bar = None
        if self.file:
            if cfg.resume:
                forget_steps_from(self.file, start_step, run_id)
            append_jsonl(self.file, [{"kind": "config", "run_id": run_id, **cfg.as_dict(),
                                      **layout, "host": ctx.host, "start_step": start_step}])
        if self.is_writer and cfg.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=cfg.steps, initial=start_step, desc=cfg.sync, unit="step",
                            dynamic_ncols=True)

    def record(self, step, local_loss, fields, ended=None):
        """This rank's step: its local loss (None where it computes none) and the
        engine's fields (times, staleness, memory, ...); ended: its time.perf_counter()
        at the step's end, where the loop waited for the others since (default: now)."""
        ended_s = (time.perf_counter() if ended is None else ended) - self._start - \
            self._flushed
        sent, received = self.traffic()
        self.pending.append({
            "kind": "step", "run_id": self.run_id, "step": step, "rank": self.rank,
            "local_loss": None if local_loss is None else float(local_loss), **fields,
            "bytes_sent": _delta(sent, self._bytes[0]),
            "bytes_received": _delta(received, self._bytes[1]),
            "peak_mem_mb": round(peak_memory_mb(self.device), 1), "ended_s": ended_s})
        self._bytes = (sent, received)
        last = step + 1 == self.cfg.steps
        if last or self.flush_every and (step + 1) % self.flush_every == 0:
            self.flush()

    def flush(self):
        began = time.perf_counter()
        try:
            self._write()
        finally:                        # kept out of every later record's ended_s
            self._flushed += time.perf_counter() - began

    def _write(self):
        # at most --timeout where the control is waits.Bounded (strategies.train's)
        gathered = waits.allgather(self.control, self.pending, "the metrics flush")
        self.pending = []
        if not self.is_writer:
            return
        for per_rank in zip(*gathered):            # the same step on every rank (in order)
            losses = [r["local_loss"] for r in per_rank if r["local_loss"] is not None]
            loss = sum(losses) / len(losses)
            for r in per_rank:
                r["loss"] = loss
            if self.file:
                append_jsonl(self.file, per_rank)
            self.overflow_skips = per_rank[0].get("overflow_skips", self.overflow_skips)
            self.steps.append((per_rank[0]["step"], loss,
                               max(r["step_time_s"] for r in per_rank),
                               max(r["comm_time_s"] for r in per_rank),
                               _total(r["bytes_sent"] for r in per_rank),
                               max(r["peak_mem_mb"] for r in per_rank)))
            if "wire_bytes" in per_rank[0]:
                self.wire.append((sum(r["wire_bytes"] for r in per_rank),
                                  sum(r["dense_bytes"] for r in per_rank)))
            if self.bar:
                self.bar.update(1)
                self.bar.set_postfix(refresh=False, loss=f"{loss:.4f}", samples_s=
                                     f"{self.cfg.global_batch / per_rank[0]['step_time_s']:.0f}")

    def summary(self, wall_s, world):
        """The writer prints and writes the run's summary; the first step (warm-up) is
        left out of the means.  `world`: how the world splits (config.world_of)."""
        if not self.is_writer:
            return None
        if self.bar:
            self.bar.close()
        timed = self.steps[1:] or self.steps
        if not timed:
            return None
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        step_s = mean([s[2] for s in timed])
        out = {"kind": "summary", "run_id": self.run_id, "sync": self.cfg.sync, **self.layout,
               "world": world, "steps": len(self.steps),
               "first_loss": self.steps[0][1], "final_loss": self.steps[-1][1],
               "mean_step_time_s": step_s, "samples_per_s": self.cfg.global_batch / step_s,
               "exposed_comm_fraction": mean([s[3] for s in timed]) / step_s,
               "bytes_sent_per_step_all_ranks":
                   None if timed[0][4] is None else mean([s[4] for s in timed]),
               "peak_mem_mb": max(s[5] for s in self.steps), "wall_s": wall_s,
               **wire_summary(self.wire),
               "config": self.cfg.as_dict()}
        if self.overflow_skips is not None:        # fp16: every rank skipped the same steps
            out["overflow_skips"] = self.overflow_skips
        print(f"[{self.cfg.sync}] {world}: steps={out['steps']} "
              f"loss {out['first_loss']:.4f} -> {out['final_loss']:.4f}  "
              f"{out['samples_per_s']:.0f} samples/s  step {1000 * step_s:.1f} ms  "
              f"exposed comm {100 * out['exposed_comm_fraction']:.0f}%  "
              f"{_size(out['bytes_sent_per_step_all_ranks'])} sent/step  "
              f"peak {out['peak_mem_mb']:.0f} MB  wall {wall_s:.1f} s" +
              (f"  overflow skips {self.overflow_skips}" if "overflow_skips" in out else ""),
              flush=True)
        if self.file:
            append_jsonl(self.file, [out])
        return out


def wire_summary(wire):
    """The mean gradient bytes per step handed to the collectives by all ranks, and
    their ratio to float32 all-reduces of the same gradients ({} where not counted)."""
    if not wire:
        return {}
    sent, dense = sum(w for w, _ in wire), sum(d for _, d in wire)
    return {"wire_bytes_per_step_all_ranks": sent / len(wire),
            "wire_ratio": sent / dense if dense else None}


def forget_steps_from(path, start_step, run_id):
    """--resume from a checkpoint at `start_step`: drop the file's step records of run
    `run_id` at or after it.  The run that wrote them went on past the checkpoint and
    died; the resumed run redoes those steps and writes them again, so keeping both
    would list each twice.  (TensorBoard's SummaryWriter(purge_step=...) does the same
    with its event files.)  Other runs' records in the file stay as they are."""
    records = read_jsonl(path)
    rewrite_jsonl(path, [r for r in records
                         if not (r.get("kind") == "step" and r.get("run_id") == run_id and
                                 r.get("step", -1) >= start_step)])


def now(device):
    """A timestamp after the device's queued work finished (CUDA kernels are asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StepClock:
    """A step's time marks, with one wait for the GPU per step instead of one per mark.

    On a CPU, or where the marks must be host times (--trace, a pipeline's spans), a
    mark is now(device).  On a GPU otherwise a mark is a CUDA event on the current
    stream, and `seconds` waits once, for the last: a host wait at every mark would
    drain the GPU's queue there, so the kernels queued next (the optimizer's, after
    backward) would start only as the CPU launches them, where a plain PyTorch loop
    launches them while the GPU still runs backward.  Times between events are the
    GPU's: the exposed communication is then the time the GPU waited for the
    gradients, from the end of backward's kernels to the stream's wait on the last
    bucket's."""

    def __init__(self, device, host_times=False):
        self.device = device
        self.events = device.type == "cuda" and not host_times

    def mark(self):
        if not self.events:
            return now(self.device)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, *marks):
        """The marks as seconds on one clock (their differences are what counts)."""
        if not self.events:
            return marks
        marks[-1].synchronize()
        first = marks[0]
        return tuple(first.elapsed_time(m) / 1000.0 for m in marks)

    @staticmethod
    def read(*values):
        """What the host reads of the step once it is done (the loss, fp16's scale), to
        ask for before the last mark: a host read after `seconds` would be a second
        wait for the GPU, and with ranks taking turns on one GPU each wait can cost
        them a turn.  Returns a HostCopy; its `values()` after `seconds`."""
        return HostCopy(values)


class HostCopy:
    """Values as Python numbers, where the GPU's tensors among them are copied into
    pinned host memory without a wait: one copy for all of them, which the wait for
    the next event recorded after it (StepClock.seconds) also waits for."""

    def __init__(self, values):
        self.given = list(values)
        self.on_gpu = [i for i, v in enumerate(self.given) if torch.is_tensor(v) and v.is_cuda]
        if self.on_gpu:
            # float64 holds the loss (float32) and the counters (int32/64) exactly
            stacked = torch.stack([self.given[i].detach().reshape(()).double()
                                   for i in self.on_gpu])
            self.host = torch.empty(len(self.on_gpu), dtype=torch.float64, pin_memory=True)
            self.host.copy_(stacked, non_blocking=True)

    def values(self):
        out = list(self.given)
        if self.on_gpu:
            for i, value in zip(self.on_gpu, self.host.tolist()):
                out[i] = value
        return [v.item() if torch.is_tensor(v) else v for v in out]


def _delta(now_bytes, before):
    """Bytes since the last step; None where the backend's traffic is not observable."""
    return None if now_bytes is None else now_bytes - before


def _total(values):
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def _size(nbytes):
    return "? bytes (not observable)" if nbytes is None else f"{format_size(round(nbytes))}B"
