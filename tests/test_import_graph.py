"""The package's import graph: no cycles, and no layer imports one above it.

The graph is read from the source (every ``import kvshare...`` / ``from kvshare... import``, at
module level or inside functions, both count; imports under ``if TYPE_CHECKING:`` count for cycles
too, since a type-only cycle is still two modules that cannot be read apart, but not for the layer
rules). A cycle is a strongly connected component of more than one module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvshare

ROOT = Path(kvshare.__file__).parent

# (package, prefixes it must not import): the layers, bottom up: config; cache / model / ops;
# engine; parallel; llm / server / train / bench; cli.
ABOVE_ENGINE = ("kvshare.parallel", "kvshare.cli", "kvshare.server", "kvshare.bench", "kvshare.llm",
                "kvshare.train")
RULES = [
    ("kvshare.config", ("kvshare.model", "kvshare.cache", "kvshare.ops", "kvshare.engine", *ABOVE_ENGINE,
                        "kvshare.topology", "kvshare.tokenizer")),
    # the per-step types: below the cache, the network and the engine (they pass through all three)
    ("kvshare.step", ("kvshare.cache", "kvshare.model", "kvshare.layers", "kvshare.weights", "kvshare.kernels",
                      "kvshare.engine", *ABOVE_ENGINE)),
    ("kvshare.cache", ("kvshare.model", "kvshare.weights", "kvshare.engine", *ABOVE_ENGINE)),
    # the network: no checkpoint I/O, no tokenizer (Engram gets its token map handed in), no server
    ("kvshare.model", ("kvshare.weights", "kvshare.tokenizer", "kvshare.engine", *ABOVE_ENGINE)),
    ("kvshare.layers", ("kvshare.weights", "kvshare.tokenizer", "kvshare.engine", *ABOVE_ENGINE)),
    ("kvshare.weights", ("kvshare.engine", *ABOVE_ENGINE)),
    # the tokenizer needs no model config and renders no tool calls (the server's job)
    ("kvshare.tokenizer", ("kvshare.config", "kvshare.server", "kvshare.model", "kvshare.engine")),
    ("kvshare.ops", ("kvshare.engine", *ABOVE_ENGINE)),
    ("kvshare.engine", ABOVE_ENGINE),
    ("kvshare.bench", ("kvshare.cli",)),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the kvshare modules it imports (see module doc); `type_checking`: with the imports
    under ``if TYPE_CHECKING:``."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = set() if type_checking else {
            id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvshare"):
                targets = [resolve(f"{node.module}.{a.name}") if f"{node.module}.{a.name}" in mods
                           else resolve(node.module) for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names if a.name.startswith("kvshare")]
            else:
                continue
            graph[m].update(t for t in targets if t is not None and t != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_planted_cycle() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_no_import_cycles_with_type_only_imports() -> None:
    """Mutation caught: `step/backend.py` importing `cache.rings.Ring` under TYPE_CHECKING (the cache
    imports the step package) makes a cycle here, not in the runtime graph."""
    assert cycles(import_graph(type_checking=True)) == []


def test_no_upward_imports() -> None:
    graph = import_graph()
    bad = sorted((m, t) for m, targets in graph.items() for t in targets for pkg, banned in RULES
                 if (m == pkg or m.startswith(pkg + ".")) and any(t == b or t.startswith(b + ".") for b in banned))
    assert bad == []
