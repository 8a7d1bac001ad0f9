"""The package's import graph, read with ``ast`` (nothing is imported): no import cycle, and no
module under core/ importing a built-in plugin by name (DESIGN.md: the core asks the registry).

Every ``.py`` file under core/, schedulers/, quant/ and plugins/ is mapped to its ``pagebatch.*``
name by pyproject.toml's ``[tool.setuptools.package-dir]``. Edges are ``import X`` and
``from X import Y`` anywhere in a file (module level and inside functions), absolute or relative;
``from P import m`` is an edge to the submodule ``P.m`` when that is a module, else to ``P``.
Importing ``a.b.c`` also runs ``a/__init__`` and ``a.b/__init__``, so those are edges too, except
for a module's own packages (they are always initialised before it: no tool counts that).
Imports under ``if TYPE_CHECKING:`` never run (annotations only) and are not edges.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"]
BUILTIN_PLUGIN_PACKAGES = ("pagebatch.schedulers", "pagebatch.quant", "pagebatch.plugins")

# Cycles tolerated for now, each written from its smallest module name in import order (a
# imports b imports ... imports a). The test asserts this is exactly what is left: it fails when
# one is fixed (take it out of here) or a new one appears. None since issue 21: keep it so.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def module_files() -> dict[str, Path]:
    """``pagebatch.*`` module name -> file, for every module of the package."""
    mods: dict[str, Path] = {}
    # longest folder first, so that core/layers maps by its own entry, not by core's
    for pkg, folder in sorted(PACKAGE_DIR.items(), key=lambda kv: -len(kv[1])):
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            name = ".".join((pkg, *rel))
            mods.setdefault(name, path)
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) bodies."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(
                t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules that importing ``name`` (its file ``path``) imports."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                src = f"{base}.{node.module}" if node.module else base
            else:
                src = node.module or ""
            for a in node.names:
                sub = f"{src}.{a.name}"
                targets.add(sub if sub in modules else src)
    out = {t for t in targets if t in modules and t != name}
    for t in targets:
        parts = t.split(".")
        for i in range(1, len(parts)):  # a.b.c runs a and a.b first, unless they hold name
            prefix = ".".join(parts[:i])
            if prefix in modules and not name.startswith(prefix + "."):
                out.add(prefix)
    return out


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The shortest cycle through each module of every strongly connected component of more
    than one module (Tarjan), each rotated to start at its smallest name. Any cycle at all puts
    its modules in such a component, so an empty result means no cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursive: the graph is ~150 modules, its depth far less
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found: set[tuple[str, ...]] = set()
    for comp in sccs:
        for start in sorted(comp):
            path = _shortest_cycle(graph, comp, start)
            if path is not None:
                i = path.index(min(path))
                found.add(tuple(path[i:] + path[:i]))
    return found


def _shortest_cycle(graph: dict[str, set[str]], comp: set[str], start: str) -> list[str] | None:
    """The shortest path start -> ... -> start inside ``comp`` (breadth first), without the
    repeated start; None if there is none."""
    prev: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1]
                if w not in seen:
                    seen.add(w)
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return None


def _show(cycle: tuple[str, ...]) -> str:
    return " -> ".join((*cycle, cycle[0]))


def test_the_walk_sees_the_whole_package():
    files = module_files()
    assert files["pagebatch"] == ROOT / "core" / "__init__.py"
    assert files["pagebatch.layers.linear"] == ROOT / "core" / "layers" / "linear.py"
    assert files["pagebatch.plugins.frontends.http.server"].parts[-4:] == (
        "plugins", "frontends", "http", "server.py")
    graph = import_graph()
    # relative and absolute edges, in functions too, and to the packages on the way
    assert "pagebatch.config" in graph["pagebatch.cli"]
    assert "pagebatch.kernels.activation" in graph["pagebatch.layers.activation"]  # in a function
    assert "pagebatch.plugins.frontends.http.server" in graph["pagebatch.plugins.frontends.http"]
    assert {"pagebatch.kernels", "pagebatch.kernels.pdl"} <= graph[
        "pagebatch.quant.kernels.wna16_gemv"]
    assert "pagebatch.quant" not in graph["pagebatch.quant.kernels.wna16_gemv"]  # its own
    # completions.py imports server.py only under TYPE_CHECKING (the Server annotation)
    assert "pagebatch.plugins.frontends.http.server" not in graph[
        "pagebatch.plugins.frontends.http.completions"]


def test_no_import_cycles_but_the_known_ones():
    found = cycles(import_graph())
    new = sorted(_show(c) for c in found - KNOWN_CYCLES)
    fixed = sorted(_show(c) for c in KNOWN_CYCLES - found)
    assert not new, "import cycles (break each with a leaf module, STYLE 16):\n" + "\n".join(new)
    assert not fixed, "known cycles that are gone (remove them from KNOWN_CYCLES):\n" + \
        "\n".join(fixed)


def _is_builtin_plugin(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in BUILTIN_PLUGIN_PACKAGES)


def test_core_imports_no_builtin_plugin():
    """core/ (pagebatch.*, but pagebatch.schedulers / .quant / .plugins) asks the registry."""
    files = module_files()
    core = ROOT / "core"
    graph = import_graph()
    bad = {m: sorted(t for t in graph[m] if _is_builtin_plugin(t)) for m in sorted(files)
           if files[m].is_relative_to(core)}
    bad = {m: ts for m, ts in bad.items() if ts}
    assert not bad, "core modules import built-in plugins by name (ask the registry):\n" + \
        "\n".join(f"{m}: {', '.join(ts)}" for m, ts in bad.items())


def test_core_import_check_sees_a_plugin_import(tmp_path):
    """The check above is not vacuous: a file with a function-level import of a built-in."""
    path = tmp_path / "cli.py"
    path.write_text("def f():\n    from pagebatch.quant.calibrate import quantize\n")
    found = imports_of("pagebatch.cli", path, set(module_files()))
    assert {t for t in found if _is_builtin_plugin(t)} == {"pagebatch.quant",
                                                            "pagebatch.quant.calibrate"}
