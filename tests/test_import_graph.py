"""The package's import graph has no circle, counting every import: module level, ``TYPE_CHECKING``
blocks and imports inside functions (which would otherwise hide one).

Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so an import of a module is also an
edge to each package above it that the importer is not already inside.
"""

from __future__ import annotations

import ast
from pathlib import Path

import specprefill_rag

PACKAGE = Path(specprefill_rag.__file__).parent
ROOT = "specprefill_rag"


def module_name(path: Path) -> str:
    parts = [ROOT, *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def imported(name: str) -> set[str]:
    """Every module of this package that ``name`` imports, anywhere in its source."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package_of(name).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return {t for t in targets if t in MODULES}


def edges(name: str) -> set[str]:
    """``imported`` plus the packages above each target that ``name`` is not inside (the root runs first)."""
    own = package_of(name)
    out = set()
    for target in imported(name) - {name}:
        parts = target.split(".")
        for depth in range(2, len(parts) + 1):
            step = ".".join(parts[:depth])
            if step in MODULES and not (own == step or own.startswith(step + ".")):
                out.add(step)
    return out - {name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_circle() -> None:
    graph = {name: edges(name) for name in MODULES}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_subpackages_import_each_other_one_way() -> None:
    """No circle between subpackages either (``backends`` <-> ``decode`` was one): shared types live in a leaf."""

    def package(name: str) -> str:
        return ".".join(name.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for name in MODULES:
        graph.setdefault(package(name), set()).update(
            package(target) for target in imported(name) if package(target) not in (package(name), ROOT)
        )
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_sees_a_circle_hidden_in_a_function() -> None:
    source = "def later():\n    from .b import x\n"
    tree = ast.parse(source)
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))  # ast.walk reaches function bodies
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_pipeline_steps_are_subpackages() -> None:
    """prompt -> draft -> selection -> backend, with the models they load and the decoding after."""
    for package in ("prompt", "draft", "kvcache", "models", "backends", "decode", "serve", "vllm_plugin"):
        assert (PACKAGE / package / "__init__.py").is_file(), package
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= 13, top
