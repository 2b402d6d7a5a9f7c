"""The import graph of shardformer, drawn from the source, against a declared layering.

    python scripts/import_graph.py [--root DIR] [--list] [--json]

Every module under python/shardformer/ and policies/ (installed as
shardformer.policies) is a node; every `import` / `from ... import` that
names another shardformer module is an arrow from the importer to the
imported module (`from .pkg import name` points at `pkg.name` when that is a
module, else at `pkg`).  Each arrow is marked by where the import sits:

    top        at module level (runs when the module is imported)
    function   inside a function or method body (runs when it is called)
    typing     under `if TYPE_CHECKING:` (never runs; left out of the counts)

The layering, leaf first.  A module may import its own layer and the layers
below it; an arrow into a higher layer is an *upward arrow*:

    0 base        config (a leaf: it imports no shardformer module), layout,
                  the _C glue (ops, compile_ops), versions, lazy init,
                  pickling (which holds the registry of objects pickled by
                  name, e.g. attention seams) and the small helpers every
                  other layer uses (hashes, inherit, packing, ...)
    1 distributed the communicators, the ledger, the region operators
                  (distributed/*), and the cross-rank checks built on them
                  (replicas, replica_drift, input_check, lockstep, step_guard,
                  backward_watch)
    2 layer       the parallel modules (layer/*) and the attention kernels'
                  glue (attention)
    3 runtime     what runs a sharded model and its state, reading layers and
                  policy *data* (StageSplit) but never a policy: pipeline/*
                  (stages, schedules), checkpoint/*, grad_norm, parallel_mesh
    4 policy      the policy machinery: Policy, Family, plan, the registry
                  (autopolicy), DerivedPolicy, the LM loss, the
                  optimizations' policy, the sharder (which binds the runtime
                  onto the model it shards)
    5 policies    the built-in per-family policies (shardformer.policies.*)
    6 api         ShardFormer, the package root, LoRA on a sharded model,
                  the launcher, the integrations

A package's `__init__` sits in the layer of its package, except the top
package (`shardformer`), which is the API.  `shardformer._C` (the C
extension) and `shardformer._cuda` (the CUDA one) are base leaves.

Importing `a.b.c` runs `a/__init__` and `a/b/__init__` first, so for the
circles an arrow into `a.b.c` also implies arrows into those packages
(`implied`, counted in the circles only; the top package `shardformer`,
which every import runs first, is left out).

It prints (and `--json` emits) four figures, each with its members:

    circles      strongly connected components of more than one module, of
                 the top-level arrows and of all arrows separately
    upward       arrows (top or function) into a higher layer
    function     imports inside functions
    private      names starting with one underscore imported from another
                 shardformer module (the module's own private names, shared)

tests/test_import_graph.py holds the figures to the levels reached, so that
they cannot grow back.  docs/how-it-works.md ("The layers of the code")
describes the layering for readers.
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import sys
from dataclasses import dataclass, field

PACKAGE = "shardformer"

# (layer name, module patterns relative to `shardformer`), leaf first.  The
# first pattern that matches decides; every module must match one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("_C", "_cuda", "config", "layout", "_versions", "ops", "recycled", "compile_ops", "hashes", "lazy",
              "inherit", "compile_refusal", "packing", "ddp_guard", "ties", "wrappers", "pickling")),
    ("distributed", ("distributed", "distributed.*", "replicas", "replica_drift", "input_check", "lockstep",
                     "step_guard", "backward_watch")),
    ("layer", ("layer", "layer.*", "attention")),
    ("runtime", ("pipeline", "pipeline.*", "decode", "decode_native", "checkpoint", "checkpoint.*", "grad_norm", "parallel_mesh")),
    ("policy", ("policy", "family", "plan", "autopolicy", "derived_policy", "derived_rules", "lm_loss", "sharder",
                "optimizations", "spec", "spec.*")),
    ("policies", ("policies", "policies.*")),
    ("api", ("", "shardformer", "lora", "launch", "integrations", "integrations.*", "verification",
             "verification.*", "__main__")),
]


@dataclass(frozen=True)
class Arrow:
    """One import: `source` imports `target` (dotted names under shardformer)
    at `line`, placed `where` ("top" | "function" | "typing")."""
    source: str
    target: str
    line: int
    where: str


@dataclass
class Graph:
    modules: dict[str, str]                      # dotted name -> file path
    arrows: list[Arrow] = field(default_factory=list)
    private: list[tuple[str, str, str, int]] = field(default_factory=list)  # (source, target, name, line)


def discover(root: str) -> dict[str, str]:
    """Dotted module name -> path, for python/shardformer/** and policies/**
    (as shardformer.policies.**)."""
    found: dict[str, str] = {}
    for base, prefix in ((os.path.join(root, "python", PACKAGE), PACKAGE),
                         (os.path.join(root, "policies"), PACKAGE + ".policies")):
        if not os.path.isdir(base):
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
            rel = os.path.relpath(dirpath, base)
            parts = [] if rel == "." else rel.split(os.sep)
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                mod = parts if name == "__init__.py" else parts + [name[:-3]]
                found[".".join([prefix] + mod)] = os.path.join(dirpath, name)
    found[PACKAGE + "._C"] = "<extension>"
    found[PACKAGE + "._cuda"] = "<extension>"   # built only with the CUDA toolkit (docs/cuda.md)
    return found


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute dotted name of `from <level dots><module> import ...` in `importer`."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


class _Walker(ast.NodeVisitor):
    """Collects (absolute module, imported names, line, where) for every import."""

    def __init__(self, importer: str, is_package: bool):
        self.importer, self.is_package = importer, is_package
        self.depth = 0          # function nesting
        self.typing = 0         # inside `if TYPE_CHECKING:`
        self.found: list[tuple[str, list[str], int, str]] = []

    def _where(self) -> str:
        return "typing" if self.typing else ("function" if self.depth else "top")

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node):
        test = node.test
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
        if name == "TYPE_CHECKING":
            self.typing += 1
            for child in node.body:
                self.visit(child)
            self.typing -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            self.found.append((alias.name, [], node.lineno, self._where()))

    def visit_ImportFrom(self, node):
        target = _resolve(self.importer, self.is_package, node.level, node.module)
        self.found.append((target, [a.name for a in node.names], node.lineno, self._where()))


def build(root: str) -> Graph:
    """The graph of the tree at `root`."""
    modules = discover(root)
    graph = Graph(modules)
    for name, path in modules.items():
        if path == "<extension>":
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        walker = _Walker(name, path.endswith("__init__.py"))
        walker.visit(tree)
        for target, names, line, where in walker.found:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            if not names:                               # import shardformer.x.y
                _add(graph, name, _known(modules, target), line, where)
                continue
            for imported in names:
                sub = f"{target}.{imported}"
                if sub in modules:                      # from .pkg import submodule
                    _add(graph, name, sub, line, where)
                    continue
                _add(graph, name, _known(modules, target), line, where)
                if imported.startswith("_") and not imported.startswith("__") and where != "typing":
                    graph.private.append((name, target, imported, line))
    graph.arrows.sort(key=lambda a: (a.source, a.line, a.target))
    return graph


def _implied(graph: Graph, kinds: tuple[str, ...]) -> set[tuple[str, str]]:
    """(source, package) for every package `import target` runs first: the
    packages enclosing `target` below the top one, except those enclosing
    `source` itself (already being imported)."""
    out = set()
    for a in graph.arrows:
        if a.where not in kinds:
            continue
        parts = a.target.split(".")
        for n in range(2, len(parts)):
            package = ".".join(parts[:n])
            if package in graph.modules and not a.source.startswith(package + ".") and package != a.source:
                out.add((a.source, package))
    return out


def _known(modules: dict[str, str], target: str) -> str:
    """`target`, or its nearest enclosing module that exists (a name imported
    through `import shardformer.x.attr` style access)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


def _add(graph: Graph, source: str, target: str, line: int, where: str) -> None:
    arrow = Arrow(source, target, line, where)
    if target and target != source and arrow not in graph.arrows:
        graph.arrows.append(arrow)


def layer_of(module: str) -> int | None:
    """The index in LAYERS of `module` (dotted, under shardformer); None: in no layer."""
    rel = module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + ".") else ("" if module == PACKAGE else module)
    for index, (_name, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if rel == pattern or (pattern.endswith("*") and fnmatch.fnmatchcase(rel, pattern)):
                return index
    return None


def circles(graph: Graph, kinds: tuple[str, ...]) -> list[list[str]]:
    """Strongly connected components of more than one module, over the
    arrows whose `where` is in `kinds` (Tarjan, iterative)."""
    succ: dict[str, set[str]] = {m: set() for m in graph.modules}
    for a in graph.arrows:
        if a.where in kinds:
            succ[a.source].add(a.target)
    for source, package in _implied(graph, kinds):
        succ[source].add(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(sorted(succ[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def _edges(graph: Graph, where: tuple[str, ...]) -> list[tuple[str, str]]:
    """Distinct (source, target) pairs over arrows placed in `where`."""
    return sorted({(a.source, a.target) for a in graph.arrows if a.where in where})


def report(graph: Graph) -> dict:
    """Every figure with its members."""
    unplaced = sorted(m for m in graph.modules if layer_of(m) is None)
    if unplaced:
        raise ValueError(f"import_graph: {', '.join(unplaced)} in no layer of LAYERS (scripts/import_graph.py); "
                         f"add each to the layer it belongs to")
    runtime = ("top", "function")
    edges = _edges(graph, runtime)
    upward = [(s, t) for s, t in edges if layer_of(t) > layer_of(s)]
    return {
        "modules": len(graph.modules),
        "arrows": len(edges),
        "circles_top": circles(graph, ("top",)),
        "circles_all": circles(graph, runtime),
        "upward": [f"{s} ({LAYERS[layer_of(s)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})" for s, t in upward],
        "function": [f"{a.source}:{a.line} -> {a.target}" for a in graph.arrows if a.where == "function"],
        "private": sorted(f"{s}:{line} <- {t}.{n}" for s, t, n, line in graph.private),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the repository root (default: this script's)")
    parser.add_argument("--list", action="store_true", help="list the members of every figure")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = parser.parse_args(argv)
    rep = report(build(args.root))
    if args.json:
        print(json.dumps(rep, indent=1))
        return 0
    print(f"modules {rep['modules']}, arrows {rep['arrows']} (distinct importer -> imported, top + function)")
    for key, title in (("circles_top", "circles (top-level imports)"), ("circles_all", "circles (all imports)"),
                       ("upward", "upward arrows"), ("function", "function-level imports"),
                       ("private", "private names imported across modules")):
        print(f"{title}: {len(rep[key])}")
        if args.list:
            for member in rep[key]:
                print("   ", " <-> ".join(member) if isinstance(member, list) else member)
    return 0


if __name__ == "__main__":
    sys.exit(main())
