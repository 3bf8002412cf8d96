"""The package's layering, read from its source: a module imports only lower levels (or its own
folder), no import cycle hides behind a lazy import, and no module imports another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "ple"

# (level, group) by module prefix, most specific first. A module may import a module of a lower
# level, or one of its own group (the same folder); never a higher level or a sibling group.
LEVELS: list[tuple[str, int, str]] = [
    ("ple.errors", 0, "errors"),
    ("ple.layout", 1, "layout"),
    ("ple._native", 2, "native"),
    ("ple.argtypes", 1, "argtypes"),
    ("ple.files", 1, "files"),
    ("ple.collective", 1, "collective"),
    ("ple.config", 2, "config"),
    ("ple.ngram", 3, "ngram"),
    ("ple.table", 3, "table"),
    ("ple.ops", 3, "ops"),
    ("ple.checkpoint", 4, "checkpoint"),
    ("ple.runtime.batch", 4, "batch"),
    ("ple.runtime.host", 4, "host"),
    ("ple.layer", 5, "layer"),
    ("ple.runtime", 6, "runtime"),
    ("ple.parallel", 6, "parallel"),
    ("ple.stats", 6, "stats"),
    ("ple.integrations", 7, "integrations"),
    ("ple.bench", 9, "bench"),
    ("ple.demo", 9, "demo"),
    ("ple.commands", 10, "commands"),
    ("ple.cli", 11, "cli"),
    ("ple", 8, "facade"),  # the package's own __init__: the public API, above the library levels
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _level(module: str) -> tuple[int, str]:
    for prefix, level, group in LEVELS:
        if module == prefix or module.startswith(prefix + "."):
            return level, group
    raise AssertionError(f"module {module} has no level in tests/test_layering.py: add it to LEVELS")


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for sub in node.body:
                for inner in ast.walk(sub):
                    if hasattr(inner, "lineno"):
                        lines.add(inner.lineno)
    return lines


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _imports(module: str) -> list[tuple[str, list[str], int]]:
    """``(imported module, imported names, line)`` for every import of ple modules, lazy ones included
    (function bodies), annotations-only imports (``if TYPE_CHECKING``) excluded."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name == "ple" or a.name.startswith("ple.")]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, _is_package(path), node)
            if target == "ple" or target.startswith("ple."):
                names = [a.name for a in node.names]
                # ``from . import x`` imports the submodule x when there is one
                subs = [n for n in names if f"{target}.{n}" in MODULES]
                out += [(f"{target}.{n}", [], node.lineno) for n in subs]
                rest = [n for n in names if n not in subs]
                if rest:
                    out.append((target, rest, node.lineno))
    return out


def test_every_module_has_a_level():
    for module in MODULES:
        _level(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_levels(module):
    level, group = _level(module)
    for target, _, line in _imports(module):
        t_level, t_group = _level(target)
        ok = t_group == group or t_level < level
        assert ok, f"{module}:{line} imports {target} (level {t_level}, {t_group}) from level {level} ({group})"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_from_other_modules(module):
    for target, names, line in _imports(module):
        if target == module:
            continue
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{module}:{line} imports private name(s) {private} from {target}"


def test_no_import_cycles():
    graph = {m: sorted({t for t, _, _ in _imports(m) if t in MODULES and t != m}) for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in graph[m]:
            # a package __init__ re-exporting its modules is the folder's facade, not a cycle
            if t == m.rsplit(".", 1)[0] and _is_package(MODULES[t]):
                continue
            if state.get(t) == 1:
                cycle = stack[stack.index(t) :] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
