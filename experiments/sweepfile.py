"""The sweep file: its schema, where each key is in it, and the checks done before running.

    settings, points = load_sweep("experiments/demo.toml")    # SweepError lists every problem

See experiments/sweep.py for the file's format.  A value of the wrong type (a
name that is a number, a list where one command belongs, `[run]` for `[[run]]`,
a timeout in words) is a problem like any other, never a traceback; the name
must be a plain folder name, since the results go to results/NAME.  So is a
file that is not UTF-8, one with no [[run]] (an empty file among them), and one
of more than MAX_POINTS points (counted from the axes, before any is made).
Every problem names its line (`key_lines`).  A point is impossible when the command
would refuse it anyway (a world size that does not split into the data-parallel
ranks, the servers and the nodes; a straggler that is not a rank; link emulation
of a baseline that cannot be slowed): better said before the first point runs
than after an hour of sweeping.
"""
import dataclasses
import itertools
import math
import os
import re
import tomllib

from .launchers import LAUNCH_KEYS, describe_cluster, launch_params, launch_problem, resolve


# command -> {key: "axis" | "list" | "scalar"}; "list" keys are joined with commas.
SCHEMA = {
    "allreduce.bench": {"world_size": "axis", "algos": "list", "ops": "list", "sizes": "list",
                        "dtype": "axis", "iters": "scalar", "warmup": "scalar",
                        "transport": "axis", "ranks_per_node": "axis", "inner": "axis",
                        "outer": "axis", "link_latency_us": "axis", "link_gbps": "axis",
                        "predict": "scalar"},
    "psrv.bench": {"workers": "axis", "servers": "axis", "sizes": "list", "reps": "scalar"},
    "experiments.calibrate": {"reps": "scalar", "ps": "scalar", "verify": "list"},
    "strategies.train": None,     # TrainConfig's fields and world_size: all axes
}
RUN_KEYS = ("command", "timeout_s", "label") + LAUNCH_KEYS   # launchers.py: where it runs
# The most points a sweep may have unless its caller raises the limit (`sweep
# --max-points N`): more is nearly always an axis written wrong (a range where one
# value was meant), and would take hours to run and minutes to check.  Counted from
# the axes before any point is made or checked.
MAX_POINTS = 10_000


class SweepError(ValueError):
    """A problem of the sweep file, with the line it is on."""


def key_lines(text):
    """{(table, index, key): line number}; (table, index, None) is the table's header.
    tomllib keeps no positions, so the file is scanned for headers and `key =`."""
    lines, table, counts = {}, None, {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        header = re.match(r"^\[\[?\s*([A-Za-z0-9_.-]+)\s*\]\]?", line)
        if header:
            table = header.group(1)
            counts[table] = counts.get(table, -1) + 1 if line.startswith("[[") else 0
            lines[(table, counts[table], None)] = number
            continue
        assign = re.match(r'^"?([A-Za-z0-9_.-]+)"?\s*=', line)
        if assign:                               # (None, 0, key): a key before any table
            index = counts[table] if table is not None else 0
            lines.setdefault((table, index, assign.group(1)), number)
    return lines


def schema_of(command):
    if command == "strategies.train":
        return {**{k: "axis" for k in defaults_of(command)}, "world_size": "axis"}
    return SCHEMA[command]


def count_points(run, schema):
    """How many points expand(run, schema) makes, without making them."""
    return math.prod(len(v) if isinstance(v, list) else 1 for k, v in run.items()
                     if k not in RUN_KEYS and schema.get(k) == "axis")


def expand(run, schema):
    """The run's points: the product of its axes, every other key as it is."""
    axes = {k: v if isinstance(v, list) else [v] for k, v in run.items()
            if k not in RUN_KEYS and schema.get(k) == "axis"}
    fixed = {k: v for k, v in run.items() if k not in RUN_KEYS and schema.get(k) != "axis"}
    for values in itertools.product(*axes.values()):
        yield {**fixed, **dict(zip(axes, values))}


def check_point(command, p):
    """None, or (key, reason) for an impossible point."""
    P = p.get("world_size", 1)                  # a whole number >= 1 (value_problems)
    if command == "allreduce.bench":
        from allreduce import ALGORITHMS
        from allreduce.bench_config import COLLECTIVES
        from allreduce.emulate import emulated
        from allreduce.units import parse_size
        for key, known in (("algos", ALGORITHMS), ("ops", COLLECTIVES)):
            bad = [a for a in p.get(key, []) if a not in known]
            if bad:
                return key, f"unknown {key} {bad}; choose from {', '.join(known)}"
        try:
            [parse_size(str(s)) for s in p.get("sizes", [])]
        except ValueError as e:
            return "sizes", f"sizes {p.get('sizes')}: {e}"
        if emulated(p) and set(p.get("algos", ["ring", "mpi"])) & {"mpi", "torch"}:
            return "link_latency_us", ("link emulation slows the textbook algorithms only; "
                                       "drop mpi and torch from algos for this point")
        if p.get("predict") and not p.get("cluster"):
            return "predict", ("predict = true reads the calibration of the point's cluster; "
                               "on this host the report predicts from the calibration record")
        k = p.get("ranks_per_node")
        if k and P % k:
            return "ranks_per_node", (f"world_size {P} does not factor into nodes of "
                                      f"{k} ranks: {P} % {k} = {P % k}")
    elif command == "strategies.train":
        from strategies.config.settings import ConfigError, TrainConfig, check_world
        fields = {k: v for k, v in p.items()                    # TrainConfig checks the rest
                  if k != "world_size" and k not in LAUNCH_KEYS}
        if fields.get("trace"):
            fields["trace"] = "trace.json"       # a switch here; the sweep picks the path
        try:
            cfg = TrainConfig(**fields)
        except ConfigError as e:                            # it names its field
            return e.field or "command", str(e)
        except TypeError as e:                              # not a field of TrainConfig
            return "command", str(e)
        try:
            check_world(cfg, P)                 # the trainer's own check against the world
        except ConfigError as e:
            return e.field or "world_size", str(e)
    return None


def read_text(path):
    """The file's text; a file that is not UTF-8 (as TOML must be) is a SweepError
    naming the line and the first byte that is not."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise SweepError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                         f"{e.start}); a sweep file is TOML, which is UTF-8") from None


def load_sweep(path, max_points=MAX_POINTS):
    """(settings, [(command, params, timeout_s, label)]); SweepError lists every problem.
    More than `max_points` points is a problem too, said before any point is made."""
    text = read_text(path)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{path}: not valid TOML: {e}") from None
    lines = key_lines(text)
    problems = []

    def bad(table, index, key, reason):
        line = (lines.get((table, index, key)) or lines.get((table, index, None))
                or lines.get((None, 0, table)) or 1)      # `run = ...` before any table
        problems.append(f"{path}:{line}: {reason}")

    for key in doc:
        if key not in ("sweep", "run"):
            bad(key, 0, None, f"unknown table [{key}]; a sweep file has [sweep] and [[run]]")
    sweep, runs = doc.get("sweep", {}), doc.get("run", [])
    if not isinstance(sweep, dict):
        bad("sweep", 0, None, "[sweep] is one table: write [sweep], not [[sweep]] or sweep = ...")
        sweep = {}
    if not (isinstance(runs, list) and all(isinstance(r, dict) for r in runs)):
        bad("run", 0, None, "[[run]] is an array of tables, one per command: write [[run]], "
                            "not [run] or run = ...")
        runs = []
    if doc.get("run", []) == []:
        bad(None, 0, None, ("the file is empty" if not text.strip() else "no [[run]] table")
            + "; a sweep needs at least one [[run]] (experiments/demo.toml is an example)")
    settings = {"name": os.path.splitext(os.path.basename(path))[0], "timeout_s": 300}
    for key, value in sweep.items():
        if key not in ("name", "timeout_s") + LAUNCH_KEYS:
            bad("sweep", 0, key, f"unknown key {key!r} in [sweep]; known: name, timeout_s, "
                                 f"{', '.join(LAUNCH_KEYS)}")
        settings[key] = value
    for key, problem_of in (("name", name_problem), ("timeout_s", timeout_problem)):
        problem = problem_of(settings[key])
        if problem:
            bad("sweep", 0, key, problem)
    points, counted, crossing = [], 0, 1
    for i, run in enumerate(runs):
        command = run.get("command")
        if not isinstance(command, str) or command not in SCHEMA:
            bad("run", i, "command", "no command in this [[run]]" if command is None else
                f"command {command!r} is not one of {', '.join(SCHEMA)}")
            continue
        problem = "timeout_s" in run and timeout_problem(run["timeout_s"])
        if problem:
            bad("run", i, "timeout_s", problem)
            continue
        if not isinstance(run.get("label", ""), str):
            bad("run", i, "label", f"label must be a string, got {run['label']!r}")
            continue
        schema = schema_of(command)
        unknown = [k for k in run if k not in RUN_KEYS and k not in schema]
        for k in unknown:
            bad("run", i, k, f"unknown key {k!r} for {command}; known: "
                             f"{', '.join(sorted(schema))}")
        if unknown:
            continue
        wrong = value_problems(run, schema, defaults_of(command))
        for k, reason in wrong:
            bad("run", i, k, reason)
        if wrong:
            continue
        for k, kind in schema.items():
            if kind == "list" and k in run and not isinstance(run[k], list):
                run[k] = [run[k]]
        # the launch: the run's own launcher and cluster, else the sweep's; a run on
        # this host or a hostfile's hosts has no cluster, whatever [sweep] names
        where = {k: ("run", i) if k in run else ("sweep", 0) for k in LAUNCH_KEYS}
        launcher = run.get("launcher", settings.get("launcher"))
        here = isinstance(launcher, str) and launcher.startswith(("local", "hostfile:"))
        cluster = run["cluster"] if "cluster" in run else None if here else settings.get("cluster")
        try:
            launcher, clusters = resolve(launcher, cluster, os.path.dirname(os.path.abspath(path)))
        except ValueError as e:
            key, reason = e.args[0]
            bad(*where[key], key, reason)
            continue
        n = count_points(run, schema) * len(clusters)
        if counted <= max_points < counted + n:
            crossing = lines.get(("run", i, None), 1)      # the [[run]] that passes the limit
        counted += n
        if counted > max_points:      # counted on, not made: the sweep is refused for its size
            continue
        for params in expand(run, schema):
            problem = None
            for cluster in clusters:
                point = launch_params(params, launcher, cluster)
                problem = launch_problem(command, point) or check_point(command, point)
                if problem:
                    shown = ", ".join(f"{k}={describe_cluster(v) if k == 'cluster' else v}"
                                      for k, v in point.items()
                                      if schema.get(k) == "axis" or k == "cluster")
                    bad(*where.get(problem[0], ("run", i)), problem[0],
                        f"impossible point{f' ({shown})' if shown else ''}: {problem[1]}")
                    break
                points.append((command, point, run.get("timeout_s", settings["timeout_s"]),
                               run.get("label", "")))
            if problem:
                break
    if counted > max_points:
        problems.append(f"{path}:{crossing}: {counted:,} points, more than the limit of "
                        f"{max_points:,} (experiments.sweepfile.MAX_POINTS); split the sweep, "
                        f"or pass --max-points {counted} to run them all")
    if problems:       # a wrong [sweep] launcher is wrong for every run: said once
        raise SweepError("\n".join(dict.fromkeys(problems)))
    return settings, points


def name_problem(name):
    """None, or why `name` cannot name a results directory: it becomes results/NAME,
    so it must stay one plain folder name (no "/", no "..": nothing outside results/)."""
    if not isinstance(name, str):
        return f"name must be a string, got {name!r}"
    if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
        return (f"name {name!r} must be a plain folder name (no '/', no leading '.'): "
                f"the results go to results/NAME")
    return None


def timeout_problem(value):
    """None, or why `value` is not a time limit in seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return f"timeout_s must be a number of seconds > 0, got {value!r}"
    return None


# The type of value a key takes where the command's default does not show it
# (None, or no default kept here), or where the sweep means something else by the
# key (`trace = true`: a switch; the sweep picks the file).
TYPE_EXAMPLES = {"ranks_per_node": 0, "link_gbps": 0.0, "reps": 0, "ps": True, "trace": True,
                 "world_size": 0}
COUNTS = ("world_size", "workers", "servers")       # ranks or processes: at least one


def type_problem(key, value, example):
    """None, or why `value` cannot be the key's value, judged by an example value."""
    if isinstance(example, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(example, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "a whole number"
        if ok and key in COUNTS and value < 1:
            ok, want = False, "a whole number >= 1"
    elif isinstance(example, float):
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(example, str):
        ok, want = isinstance(value, str), "a string"
    else:
        return None
    return None if ok else f"{key} must be {want}, got {value!r}"


def value_problems(run, schema, defaults):
    """[(key, reason)] for the run's values of the wrong type; an axis's values one by one."""
    problems = []
    for key, value in run.items():
        kind = schema.get(key)
        if key in RUN_KEYS or kind in (None, "list"):
            continue
        example = TYPE_EXAMPLES.get(key, defaults.get(key))
        for v in value if kind == "axis" and isinstance(value, list) else [value]:
            problem = type_problem(key, v, example)
            if problem:
                problems.append((key, problem))
                break
    return problems


def defaults_of(command):
    """The values the command uses for the keys a point leaves out."""
    if command == "strategies.train":
        from strategies.config.settings import TrainConfig
        return {f.name: f.default for f in dataclasses.fields(TrainConfig)
                if f.name not in ("jsonl", "progress")}
    if command == "allreduce.bench":
        from allreduce.bench_config import parse_args
        return {**{k: v for k, v in vars(parse_args([])).items() if k != "jsonl"},
                "world_size": 1}
    if command == "psrv.bench":
        # workers, servers and reps: the sweep's own, it always passes them (sweep.command_line);
        # sizes: the bench's, passed only when the point names them
        from psrv.bench_config import parser
        return {"workers": 1, "servers": 1, "reps": 3,
                "sizes": parser().get_default("sizes").split(",")}
    return {}


def full_config(command, params):
    """The point's config with every default the command would use filled in
    (what each record carries as "config"); the point's own keys win."""
    return {**defaults_of(command), **params}
