"""Per-step, per-rank records as JSON Lines, a progress bar, and the end-of-run summary.

Record kinds in --jsonl FILE (written by data-parallel rank 0 only):
    {"kind": "config", ...the resolved TrainConfig..., "world_size", "dp_size", "host"}
    {"kind": "step", "step", "rank", "loss", "local_loss", "step_time_s", "compute_time_s",
     "comm_time_s", "bytes_sent", "bytes_received", "peak_mem_mb", "staleness"}   per rank
    {"kind": "summary", ...}
Without --resume the file is emptied first (one run a file); with --resume the step
records at or after the checkpoint's step are dropped (forget_steps_from), the rest kept.

`loss` is the loss of the whole global batch: the mean of the ranks' local
losses, each a mean over B/P samples, so it equals the one-process loss on B
samples and runs of any P compare directly.  `comm_time_s` is the *exposed*
communication: the time the main thread was blocked waiting for the sync after
backward (communication hidden behind backward is not in it).  `bytes_*` are
this step's traffic of this rank.

Records are gathered to rank 0 every `flush_every` steps with one small
collective over the data-parallel ranks.  Synchronous syncs flush every step
(the bar shows the global loss at once); ASP/SSP flush every 20 steps, so the
metrics do not keep fast workers in lock-step with slow ones.
"""
import resource
import time

import torch

from allreduce.records import append_jsonl, read_jsonl, rewrite_jsonl, truncate_jsonl


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


class Metrics:
    def __init__(self, cfg, ctx, control, device, sync, start_step, samples_per_step):
        self.cfg, self.ctx, self.control, self.device = cfg, ctx, control, device
        self.is_writer = ctx.dp_rank == 0
        self.flush_every = 1 if cfg.synchronous else 20
        self.pending, self.steps = [], []
        self.samples_per_step = samples_per_step
        self.start_step = start_step
        self._bytes = (sync.bytes_sent, sync.bytes_received)   # setup's broadcast is not a step
        self.file = cfg.jsonl if self.is_writer else ""
        self.bar = None
        if self.file:
            if cfg.resume:
                forget_steps_from(self.file, start_step)
            else:
                truncate_jsonl(self.file)          # one run a file (the benchmarks append)
            self._write({"kind": "config", **cfg.as_dict(), "world_size": ctx.world_size,
                         "dp_size": ctx.dp_size, "host": ctx.host, "start_step": start_step})
        if self.is_writer and cfg.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=cfg.steps, initial=start_step, desc=cfg.sync, unit="step",
                            dynamic_ncols=True)

    def _write(self, *records):
        append_jsonl(self.file, records)

    def record(self, step, loss, step_time, compute_time, comm_time, sync):
        sent, received = sync.bytes_sent, sync.bytes_received
        self.pending.append({
            "kind": "step", "step": step, "rank": self.ctx.rank, "local_loss": float(loss),
            "step_time_s": step_time, "compute_time_s": compute_time, "comm_time_s": comm_time,
            "bytes_sent": _delta(sent, self._bytes[0]),
            "bytes_received": _delta(received, self._bytes[1]),
            "peak_mem_mb": round(peak_memory_mb(self.device), 1), "staleness": sync.staleness})
        self._bytes = (sent, received)
        last = step + 1 == self.cfg.steps
        if len(self.pending) >= self.flush_every or last:
            self.flush()

    def flush(self):
        gathered = self.control.allgather(self.pending)
        self.pending = []
        if not self.is_writer:
            return
        for per_rank in zip(*gathered):            # the same step on every rank (in order)
            loss = sum(r["local_loss"] for r in per_rank) / len(per_rank)
            for r in per_rank:
                r["loss"] = loss
            if self.file:
                self._write(*per_rank)
            self.steps.append((per_rank[0]["step"], loss,
                               max(r["step_time_s"] for r in per_rank),
                               max(r["comm_time_s"] for r in per_rank),
                               _total(r["bytes_sent"] for r in per_rank),
                               max(r["peak_mem_mb"] for r in per_rank)))
            if self.bar:
                self.bar.update(1)
                self.bar.set_postfix(refresh=False, loss=f"{loss:.4f}", samples_s=
                                     f"{self.samples_per_step / per_rank[0]['step_time_s']:.0f}")

    def summary(self, wall_s):
        """Rank 0 prints and writes the run's summary; the first step (warm-up) is left out."""
        if not self.is_writer:
            return None
        if self.bar:
            self.bar.close()
        timed = self.steps[1:] or self.steps
        if not timed:
            return None
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        step_s = mean([s[2] for s in timed])
        out = {"kind": "summary", "sync": self.cfg.sync, "world_size": self.ctx.world_size,
               "dp_size": self.ctx.dp_size, "steps": len(self.steps),
               "first_loss": self.steps[0][1], "final_loss": self.steps[-1][1],
               "mean_step_time_s": step_s, "samples_per_s": self.samples_per_step / step_s,
               "exposed_comm_fraction": mean([s[3] for s in timed]) / step_s,
               "bytes_sent_per_step_all_ranks":
                   None if timed[0][4] is None else mean([s[4] for s in timed]),
               "peak_mem_mb": max(s[5] for s in self.steps), "wall_s": wall_s,
               "config": self.cfg.as_dict()}
        print(f"[{self.cfg.sync}] dp={self.ctx.dp_size} steps={out['steps']} "
              f"loss {out['first_loss']:.4f} -> {out['final_loss']:.4f}  "
              f"{out['samples_per_s']:.0f} samples/s  step {1000 * step_s:.1f} ms  "
              f"exposed comm {100 * out['exposed_comm_fraction']:.0f}%  "
              f"{_mib(out['bytes_sent_per_step_all_ranks'])} sent/step  "
              f"peak {out['peak_mem_mb']:.0f} MB  wall {wall_s:.1f} s", flush=True)
        if self.file:
            self._write(out)
        return out


def forget_steps_from(path, start_step):
    """--resume from a checkpoint at `start_step`: drop the file's step records at or
    after it.  The run that wrote them went on past the checkpoint and died; the resumed
    run redoes those steps and writes them again, so keeping both would list each twice.
    (TensorBoard's SummaryWriter(purge_step=...) does the same with its event files.)"""
    records = read_jsonl(path)
    rewrite_jsonl(path, [r for r in records
                         if not (r.get("kind") == "step" and r.get("step", -1) >= start_step)])


def now(device):
    """A timestamp after the device's queued work finished (CUDA kernels are asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _delta(now_bytes, before):
    """Bytes since the last step; None where the backend's traffic is not observable."""
    return None if now_bytes is None else now_bytes - before


def _total(values):
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def _mib(nbytes):
    return "? MiB (not observable)" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"
