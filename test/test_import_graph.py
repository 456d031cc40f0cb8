"""The package's imports point down: no module of ``qstate`` reaches itself through its own imports,
counting imports inside functions (which only defer a circle, they do not remove it)."""

from __future__ import annotations

import ast
import pathlib

import qstate

PACKAGE = pathlib.Path(qstate.__file__).resolve().parent


def module_name(path: pathlib.Path) -> str:
    """``PACKAGE/optim/_step.py`` -> ``qstate.optim._step`` (``test_step_calls.py`` names frames by it too)."""
    parts = ("qstate",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The qstate modules ``path`` imports anywhere in it (``from pkg import mod`` counts ``pkg.mod``
    where that is a module, else ``pkg``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of ``graph`` as the modules along it, or ``[]``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_no_module_reaches_itself_through_its_imports() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    graph = {module_name(f): _imports(f, modules) for f in files}
    assert graph["qstate._state"] == {"qstate._op_table", "qstate._state_kernels", "qstate.formats",
                                      "qstate.formats.map_formats"}  # seen
    assert _cycle(graph) == []
