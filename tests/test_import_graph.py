"""The package's import graph: no cycle between modules (lazy imports included), and the layers import
one way (decode -> backends -> model -> kernels; nothing below knows of the CLI, serving, bench or
builder); no two subpackages import each other."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tokenswift_trt"
# layer -> the top-level subpackages it must not import
FORBIDDEN = {
    "kernels": {"decode", "model", "backends", "builder", "serving", "cli", "bench", "training"},
    "model": {"decode", "backends", "builder", "serving", "cli", "bench", "training"},
    "backends": {"decode", "builder", "serving", "cli", "bench", "training"},
    "decode": {"builder", "serving", "cli", "bench", "training"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body."""
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            edges[name].update(t for t in targets if t in modules and t != name)
    return edges


def test_no_module_imports_itself_through_others():
    edges = _edges(_modules())
    state: dict[str, int] = {}  # 1 on the path, 2 done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [module, target])
            elif target not in state:
                visit(target, path + [module])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_layers_import_one_way():
    wrong = []
    for module, targets in _edges(_modules()).items():
        layer = module.split(".")[1] if "." in module else ""
        for target in targets:
            if "." in target and target.split(".")[1] in FORBIDDEN.get(layer, ()):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layering: " + ", ".join(sorted(wrong))


def test_no_two_subpackages_import_each_other():
    modules = _modules()
    subpackage = {  # module -> its subpackage (None for a top-level module such as api.py)
        name: path.relative_to(PACKAGE).parts[0] if len(path.relative_to(PACKAGE).parts) > 1 else None
        for name, path in modules.items()
    }
    imports: dict[str, set[str]] = {}  # subpackage -> the other subpackages it imports
    for module, targets in _edges(modules).items():
        own = subpackage[module]
        if own is not None:
            others = {subpackage[target] for target in targets} - {None, own}
            imports.setdefault(own, set()).update(others)
    both_ways = sorted(
        f"{first} <-> {second}"
        for first, targets in imports.items()
        for second in targets
        if first < second and first in imports.get(second, set())
    )
    assert not both_ways, "subpackages that import each other: " + ", ".join(both_ways)
