"""The package's module graph has no import cycles, and only cli/ imports cli/.

The graph is read from the source with `ast`, so it counts every import a module can run:
module-level and nested (function-level, lazy) imports, `import a.b`, `from a import b` where
`b` may be a submodule, and relative imports. An edge goes to the module itself, not to the
packages above it (their `__init__` files hold docstrings only). Imports under
`if TYPE_CHECKING:` are left out: they name a type for the checker and never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file, for every .py file under root/package."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module of the package, or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` (imports for annotations
    only, never run; their `else:` branch does run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.append(node.test)
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `module` (at `path`) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from a import b`: b is a submodule when a.b is a module, else a name in a.
            targets = [f"{stem}.{alias.name}" for alias in node.names if alias.name != "*"] + [stem]
            targets = [t for t in targets[:-1] if t in modules] or [stem]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                out.add(resolved)
    return out


def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    modules = module_names(root, package)
    return {m: imported_modules(m, p, modules) for m, p in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_walker_finds_a_cycle_through_lazy_relative_and_submodule_imports(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from .sub import b\n",  # nested, relative, b is a submodule
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "import pkg.c\n",  # `import a.b`
        "pkg/c.py": "from pkg.a import f\n",  # `from a import name`
        "pkg/d.py": "from . import a\n",  # outside the cycle
    })
    graph = module_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_walker_passes_an_acyclic_package(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "import os\n",
        "pkg/high.py": "from .low import x\nfrom pkg import low\n",
        "pkg/sub/__init__.py": "from .. import high\n",
    })
    graph = module_graph(tmp_path, "pkg")
    assert graph["pkg.high"] == {"pkg.low"}
    assert graph["pkg.sub"] == {"pkg.high"}
    assert import_cycles(graph) == []


def test_type_checking_imports_are_not_edges_but_their_else_branch_is(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": ("import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import X\n"
                     "else:\n    from pkg import c\n"),
        "pkg/c.py": "",
    })
    graph = module_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.c"}
    assert import_cycles(graph) == []


def test_lopd_cli_has_no_import_cycles():
    graph = module_graph(ROOT, "lopd_cli")
    assert len(graph) > 50  # the walker saw the package
    cycles = import_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_only_the_command_layer_imports_it():
    """cli/ sits on top: nothing under lopd_cli/ imports it except cli/ itself and `__main__`
    (`python -m lopd_cli`, the same entry point as the `lopd` script)."""
    graph = module_graph(ROOT, "lopd_cli")
    entry = {"lopd_cli.__main__"}
    offenders = sorted(f"{m} -> {t}" for m, targets in graph.items()
                       if not m.startswith("lopd_cli.cli.") and m not in entry
                       for t in targets if t == "lopd_cli.cli" or t.startswith("lopd_cli.cli."))
    assert not offenders, "imports of lopd_cli.cli from below it: " + ", ".join(offenders)
