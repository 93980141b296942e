"""Tier (a): the import graph of the four packages has no cycle and points downward only.

    experiments -> strategies -> psrv -> allreduce        (arrows: "imports")

The graph is read from the source, not from running it: every `import` and
`from ... import` statement of every .py file, at module level or inside a
function (a function-level import is still a dependency, only a later one),
relative ones resolved against the file's package.  A package's __init__ is a
module of its own: `import strategies` is an edge to strategies/__init__.py,
`from strategies import train` an edge to strategies.train (a name that is not
a module resolves to the package).  Importing a submodule does not add an edge
to its parent packages here: Python runs their __init__ first, but a package's
__init__ that needs its submodule is not a circle the reader has to untangle.

A cycle is a strongly connected component of more than one module; the failure
message shows each as a path that leaves a module and comes back to it.
"""
import ast
import os
from collections import deque

import pytest
from conftest import ROOT

LAYERS = ("allreduce", "psrv", "strategies", "experiments")     # lowest first


def module_files():
    """{dotted module name: path} of every .py file in the four packages."""
    modules = {}
    for package in LAYERS:
        for folder, dirs, files in os.walk(ROOT / package):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = path
    return modules


def resolve(name, modules):
    """The longest prefix of a dotted name that is one of our modules, or None."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module, path, modules):
    """The modules of ours that `module` imports anywhere in its file."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                       # relative: up level - 1 packages
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # `from pkg import sub` names the module pkg.sub where there is one
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                     for alias in node.names]
        else:
            continue
        found.update(r for r in (resolve(n, modules) for n in names) if r and r != module)
    return found


def import_graph():
    modules = module_files()
    return {m: imports_of(m, path, modules) for m, path in modules.items()}


def strongly_connected(graph):
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def a_cycle_through(start, members, graph):
    """A shortest path start -> ... -> start inside one component (breadth first)."""
    before = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & set(members)):
            if child == start:
                path = [node]
                while before[path[-1]] is not None:
                    path.append(before[path[-1]])
                return list(reversed(path)) + [start]
            if child not in before:
                before[child] = node
                queue.append(child)
    return [start]


def cycles(graph):
    """Each component of more than one module, as one cycle through its first member."""
    return [a_cycle_through(c[0], c, graph) for c in strongly_connected(graph) if len(c) > 1]


@pytest.mark.timeout(60)
def test_the_reader_finds_both_kinds_of_import():
    """The graph sees a relative import, a function-level import and a package __init__."""
    graph = import_graph()
    assert "strategies.config.choices" in graph["strategies.config.settings"]        # from .choices import
    assert "strategies" in graph["strategies.example_user_model"]    # import strategies
    assert graph["strategies"] >= {"strategies.engine.optimizer"}           # inside __getattr__
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


@pytest.mark.timeout(60)
def test_no_import_cycle():
    found = cycles(import_graph())
    shown = "\n".join(" -> ".join(c) for c in found)
    assert not found, f"{len(found)} import cycle(s) (strongly connected components of " \
                      f"more than one module, one cycle shown for each):\n{shown}"


@pytest.mark.timeout(60)
def test_packages_import_only_downward():
    """allreduce imports none of the others, psrv only allreduce, strategies no experiments."""
    layer = {name: i for i, name in enumerate(LAYERS)}
    upward = sorted(f"{source} -> {target}" for source, targets in import_graph().items()
                    for target in targets
                    if layer[target.split(".")[0]] > layer[source.split(".")[0]])
    assert not upward, "imports that point up the layers " \
                       f"({' -> '.join(reversed(LAYERS))}):\n" + "\n".join(upward)


# The worker's own layers, lowest first: each subpackage of strategies/ imports only
# from its own and the ones before it; the modules at strategies/'s top (train.py,
# bench.py, compatibility.py, ...) sit above them all.
WORKER_LAYERS = ("config", "model", "runtime", "compression", "sync", "parallel", "engine")


def worker_layer(module):
    """The index of a strategies module's subpackage; len(WORKER_LAYERS) for the top."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in WORKER_LAYERS:
        return WORKER_LAYERS.index(parts[1])
    return len(WORKER_LAYERS)


@pytest.mark.timeout(60)
def test_the_worker_layers_import_only_downward():
    """config <- model <- runtime <- compression <- sync <- parallel <- engine <- the
    commands: a step engine may use a parallelism, a parallelism a sync, never back."""
    graph = import_graph()
    assert {m.split(".")[1] for m in graph if m.count(".") >= 2 and
            m.startswith("strategies.")} == set(WORKER_LAYERS)
    upward = sorted(f"{source} -> {target}" for source, targets in graph.items()
                    if source.startswith("strategies.") for target in targets
                    if target.startswith("strategies.")
                    and worker_layer(target) > worker_layer(source))
    assert not upward, "imports that point up the worker's layers " \
                       f"({' <- '.join(WORKER_LAYERS)} <- the commands):\n" + "\n".join(upward)


TORCH_FREE = ("experiments.cluster.cli", "experiments.labs.check_ring",
              "experiments.labs.check_ps", "allreduce.records", "allreduce.units",
              "strategies.config.choices")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_light_tools_load_without_torch(module):
    """The cluster's commands and the lab checkers start in well under a second: importing
    torch takes seconds a process, and allreduce loads its collectives on first use."""
    import subprocess
    import sys
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch loaded'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=50)
    assert result.returncode == 0, result.stderr[-2000:]
