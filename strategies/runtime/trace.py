"""A per-rank timeline of forward, backward, communication and idle time, as a Chrome trace.

    tracer = Tracer(rank)
    with tracer.span("forward mb 3", "forward"):
        ...
    write_chrome_trace("run.json", control.allgather(tracer.events), labels)

Open the file in https://ui.perfetto.dev (or chrome://tracing): one process per
rank, one track each.  Categories:

    forward, backward   compute of one micro-batch (or of the whole local batch)
    comm                a collective or a send that this rank waited for
    dp-comm             a data-parallel collective on the comm thread (comm_thread.py),
                        beside backward: a track of its own; only the "wait for
                        gradients" span it leaves at the end is exposed ("comm")
    idle                waiting for a peer's activation or gradient: in a pipeline,
                        these are the bubbles of GPipe and 1F1B
    optimizer, step     the update; the whole step
    recompute           --recompute: a block's forward re-run inside backward
                        (recompute.py); nested in its backward span, so not added
                        to the busy time again

Timestamps are `time.perf_counter()`, CLOCK_MONOTONIC on Linux, which every
process on one host shares, so the ranks' tracks line up; on several hosts
each host's track is shifted by its own clock's offset.
"""
import json
import time
from contextlib import contextmanager, nullcontext

BUSY = ("forward", "backward")
BESIDE = ("dp-comm",)            # spans of the comm thread, not of the main thread


class Tracer:
    def __init__(self, rank):
        self.rank = rank
        self.events = []             # (name, category, start s, end s)

    @contextmanager
    def span(self, name, category):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, category, start, time.perf_counter())

    def add(self, name, category, start, end):
        self.events.append((name, category, start, end))

    def since(self, start):
        """Events that began at or after `start`."""
        return [e for e in self.events if e[2] >= start]


def span(tracer, name, category):
    """tracer.span(name, category), or nothing where the run is not traced (tracer None)."""
    return nullcontext() if tracer is None else tracer.span(name, category)


def busy_seconds(events, categories=BUSY):
    return sum(end - start for _, cat, start, end in events if cat in categories)


def chrome_events(events, pid, label):
    out = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}},
           {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
    for name, cat, start, end in events:
        event = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": int(cat in BESIDE),
                 "ts": round(start * 1e6, 3), "dur": round((end - start) * 1e6, 3)}
        if cat in COLOURS:
            event["cname"] = COLOURS[cat]
        out.append(event)
    return out


# Chrome's reserved colour names, so that the kinds stand apart in Perfetto too
COLOURS = {"forward": "good", "backward": "rail_animation", "comm": "terrible",
           "idle": "grey", "optimizer": "yellow", "step": "black",
           "recompute": "olive", "dp-comm": "bad"}


def write_chrome_trace(path, events_per_rank, labels):
    """One JSON file, a process per rank: events_per_rank[r] are rank r's events."""
    trace = []
    for rank, events in enumerate(events_per_rank):
        trace.extend(chrome_events(events, rank, labels[rank]))
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
