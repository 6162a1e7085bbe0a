"""The package's import graph: no import cycles, and the arrows between folders pointing one way.

Every module of specrt (each .py under the repo root, except tests/, docs/, build/ and hidden dirs such
as .venv/) is parsed with ``ast``; its arrows are its ``import`` / ``from ... import`` statements, at
module level and inside functions alike, relative ones resolved. ``python tests/test_layout.py``
prints the graph (modules, folders, cycles).

Folders: the top-level modules ``contract`` and ``trees``; the packages ``custom_ops`` (specrt's own native code, built
from source: ONNX Runtime kernels, suffix decoding's index), ``engines``, ``export`` and
``tools`` (with its subpackages); ``runtime``, the decode core, and ``runtime.serve``, the server on top
of it, counted apart; and ``specrt``, the package's own ``__init__.py`` (the facade: ``load``,
``__version__``, the error names).
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repo root is the package
PACKAGE = "specrt"
SKIPPED = {"tests", "docs", "build"}  # and every hidden dir (.venv, .git, ...)

FOLDERS = ("contract", "trees", "custom_ops", "engines", "runtime", "runtime.serve", "export", "tools", "specrt")
ALLOWED = {  # folder -> the other folders it may import: arrows point down this table, never up
    "contract": set(),
    "trees": set(),
    "custom_ops": set(),
    "engines": {"contract", "trees", "custom_ops"},
    "runtime": {"contract", "trees", "engines", "custom_ops"},  # the decode core: never runtime.serve, export or tools
    "runtime.serve": {"contract", "trees", "engines", "runtime", "specrt"},
    "export": {"contract", "trees", "engines", "specrt"},  # specrt: __version__ for the manifest
    "specrt": {"contract", "trees", "engines", "runtime"},  # the facade: load() imports runtime.api
    "tools": set(FOLDERS) - {"tools"},
}

def find_modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, is a package __init__)} of every module of the package."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIPPED or any(p.startswith(".") for p in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join([PACKAGE, *parts])] = (path, is_package)
    return modules


def _known_module(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is a module of the package (``specrt.x.Name`` -> ``specrt.x``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _source_of(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from`` statement reads from, relative levels resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, modules) -> set[str]:
    """The package's modules ``module`` imports, anywhere in its file."""
    path, is_package = modules[module]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_known_module(a.name, modules) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _source_of(node, module, is_package)
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in modules else _known_module(source, modules))
    return {m for m in found if m and m != module}


def import_graph(modules=None) -> dict[str, set[str]]:
    modules = modules or find_modules()
    return {m: imports_of(m, modules) for m in modules}


def folder_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "specrt"
    if parts[:2] == ["runtime", "serve"]:
        return "runtime.serve"
    return parts[0]


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan): each is one or more import cycles."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def folder_arrows(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """{(folder, imported folder): [(module, imported module), ...]} for arrows that leave a folder."""
    arrows = defaultdict(list)
    for module, targets in graph.items():
        for target in sorted(targets):
            if folder_of(target) != folder_of(module):
                arrows[folder_of(module), folder_of(target)].append((module, target))
    return dict(arrows)


# ---- tests ---------------------------------------------------------------------------------------
def test_the_walk_sees_every_folder_and_function_level_imports():
    modules = find_modules()
    assert {folder_of(m) for m in modules} == set(FOLDERS), "a new folder: give it a row in ALLOWED"
    assert "specrt.export.onnx_export" in modules and not any(".tests." in m or ".venv" in m for m in modules)
    graph = import_graph(modules)
    assert "specrt.runtime.api" in graph["specrt"]  # imported inside specrt.load() only


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"import cycles: {[sorted(c) for c in found]}"


def test_arrows_between_folders_point_one_way():
    arrows = folder_arrows(import_graph())
    bad = [edge for (src, dst), edges in sorted(arrows.items()) if dst not in ALLOWED[src] for edge in edges]
    assert not bad, "imports against the folder order (see ALLOWED):\n" + "\n".join(f"  {a} -> {b}" for a, b in bad)


def test_the_folder_order_itself_has_no_cycle():
    allowed = {src: {dst for dst in dsts if dst != src} for src, dsts in ALLOWED.items()}
    assert not cycles(allowed)


def test_export_imports_neither_runtime_nor_tools_and_has_no_cycle():
    """Issue 27: export/'s own graph is acyclic (head definitions <- upstream readers <- head modules <- the
    head exporters <- the export driver) and it never reaches the runtime or the tools."""
    graph = import_graph()
    export = {m: {t for t in ts if folder_of(t) == "export"} for m, ts in graph.items() if folder_of(m) == "export"}
    assert not cycles(export)
    reached = {folder_of(t) for m in export for t in graph[m]}
    assert not reached & {"runtime", "runtime.serve", "tools"}


if __name__ == "__main__":
    graph = import_graph()
    print("modules (-> the package's modules each imports):")
    for module in sorted(graph):
        print(f"  {module} -> {', '.join(sorted(graph[module])) or '-'}")
    print("folders (-> imported folder: how many arrows):")
    for (src, dst), edges in sorted(folder_arrows(graph).items()):
        flag = "" if dst in ALLOWED[src] else "   AGAINST THE ORDER"
        print(f"  {src} -> {dst}: {len(edges)}{flag}")
    print("cycles:", [sorted(c) for c in cycles(graph)] or "none")
