"""The package's layering, read from its source: every module has a level, a module imports only
lower levels (or its own folder), no import cycle hides behind a lazy or an annotations-only import,
and no module reaches into another's private names (imported, or read through a module) or into a
private module of another package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "ple"

# (module or package, level, group). A module's level is its own entry, or else that of the nearest
# package entry above it (a package entry covers its folder); ``ple`` itself is the facade
# (``ple/__init__.py``) and covers nothing else, so a new top-level module needs its own line. A
# module may import a module of a lower level, or one of its own group (the same folder); never a
# higher level or a sibling group.
LEVELS: list[tuple[str, int, str]] = [
    ("ple.errors", 0, "errors"),
    ("ple.layout", 1, "layout"),
    ("ple.common", 1, "common"),
    ("ple.kernels", 2, "kernels"),
    ("ple.config", 2, "config"),
    ("ple.ngram", 3, "ngram"),
    ("ple.table", 3, "table"),
    ("ple.ops", 3, "ops"),
    ("ple.checkpoint", 4, "checkpoint"),
    ("ple.data", 4, "data"),
    ("ple.runtime.batch", 4, "batch"),
    ("ple.runtime.host", 4, "host"),
    ("ple.runtime.native_step", 4, "native_step"),
    ("ple.layer", 5, "layer"),
    ("ple.convert", 5, "convert"),
    ("ple.runtime", 6, "runtime"),
    ("ple.parallel", 6, "parallel"),
    ("ple.train", 6, "train"),
    ("ple.integrations", 7, "integrations"),
    ("ple.commands", 10, "commands"),
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


def _level(module: str, packages: set[str] | None = None) -> tuple[int, str]:
    """The (level, group) of ``module``: its own entry, or the nearest package entry above it.

    ``packages``: the names that are packages (default: those of the source tree); only a package
    entry other than the facade ``ple`` covers the modules below it."""
    if packages is None:
        packages = PACKAGES
    best: tuple[str, int, str] | None = None
    for name, level, group in LEVELS:
        covers = module == name or (name != "ple" and name in packages and module.startswith(name + "."))
        if covers and (best is None or len(name) > len(best[0])):
            best = (name, level, group)
    if best is None:
        raise AssertionError(f"module {module} has no level in tests/test_layering.py: add it to LEVELS")
    return best[1], best[2]


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
PACKAGES = {m for m, p in MODULES.items() if _is_package(p)}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_package_outside(target: str, module: str) -> str | None:
    """The private module or package named by ``target`` (``ple.ops.conv._checks``) that ``module``
    is not inside the parent package of, or None: a ``_private`` module belongs to its own folder."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if _is_private(part):
            parent = ".".join(parts[:i])
            if not (module == parent or module.startswith(parent + ".")):
                return ".".join(parts[: i + 1])
    return None


def _imports(module: str, annotations: bool = False) -> list[tuple[str, list[str], int]]:
    """``(imported module, imported names, line)`` for every import of ple modules, lazy ones included
    (function bodies), annotations-only imports (``if TYPE_CHECKING``) included only if ``annotations``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if annotations else _type_checking_lines(tree)
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


def _module_aliases(module: str, tree: ast.AST) -> dict[str, str]:
    """Local names bound to ple modules by imports anywhere in ``module`` (``import ple.x as y``,
    ``from . import cases as bench_cases``, ``import ple.x`` binding ``ple``)."""
    is_package = _is_package(MODULES[module])
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "ple" or a.name.startswith("ple."):
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            for a in node.names:
                if f"{target}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{target}.{a.name}"
    return aliases


def _private_attributes(module: str, tree: ast.AST | None = None) -> list[tuple[str, str, int]]:
    """``(ple module, private name, line)`` for every ``alias._name`` read in ``module`` (its source,
    or ``tree``) where the alias is a ple module other than ``module`` itself
    (``bench_cases._dtype_name``)."""
    if tree is None:
        path = MODULES[module]
        tree = ast.parse(path.read_text(), str(path))
    aliases = _module_aliases(module, tree)
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain: list[str] = []
        inner: ast.expr = node
        while isinstance(inner, ast.Attribute):
            chain.append(inner.attr)
            inner = inner.value
        if not isinstance(inner, ast.Name) or inner.id not in aliases:
            continue
        target = aliases[inner.id]
        for attr in reversed(chain):
            if f"{target}.{attr}" in MODULES:
                target = f"{target}.{attr}"
                continue
            if _is_private(attr) and target != module:
                found.add((target, attr, node.lineno))
            break
    return sorted(found, key=lambda f: (f[2], f[0], f[1]))


def test_every_module_has_a_level():
    for module in MODULES:
        _level(module)


def test_every_levels_entry_names_a_module():
    names = [name for name, _, _ in LEVELS]
    assert len(names) == len(set(names)), "an entry of LEVELS appears twice"
    stale = [name for name in names if name not in MODULES]
    assert not stale, f"LEVELS names modules that do not exist: {stale}"


def test_level_lookup_is_exact():
    """An unlisted module is reported, not covered by the facade or by a module that shares its prefix."""
    packages = PACKAGES | {"ple.newpackage"}  # a new package with no entry of its own
    for unlisted in (
        "ple.newmodule",
        "ple.newpackage",
        "ple.newpackage.part",
        "ple.errors_extra",
        "ple.errors.sub",
        "ple.cli2",
    ):
        with pytest.raises(AssertionError, match=f"module {unlisted} has no level"):
            _level(unlisted, packages)
    assert _level("ple", packages) == (8, "facade")
    assert _level("ple.ngram.new_twin", packages) == _level("ple.ngram", packages)
    assert _level("ple.runtime.batch", packages) == (4, "batch")  # its own entry, not its package's
    assert _level("ple.runtime.session", packages) == (6, "runtime")


def test_private_checks_catch_reach_ins():
    """The private-name checks can fail: a private module of another package, and a private name
    read through a module alias, are both reported."""
    assert _private_package_outside("ple.ops.conv._checks", "ple.ops.fused.native") == "ple.ops.conv._checks"
    assert _private_package_outside("ple.ops.fused._compose", "ple.ops.fused.reference") is None
    assert _private_package_outside("ple.ops.fused._compose", "ple.ops.fused") is None
    assert _private_package_outside("ple.kernels.native", "ple.ngram.native") is None
    assert _private_package_outside("ple.a._b.c", "ple.a.d") is None
    assert _private_package_outside("ple.a._b.c", "ple.x.d") == "ple.a._b"
    src = (
        "from . import cases as bench_cases\n"
        "import ple.ops.fused as fused\n"
        "import ple.layout\n"
        "def f():\n"
        "    return bench_cases._dtype_name, fused.native._lib, ple.layout._x, bench_cases.__name__, fused.gate_conv\n"
    )
    tree = ast.parse(src)
    module = "ple.commands.bench.runner"
    aliases = _module_aliases(module, tree)
    assert aliases == {"bench_cases": "ple.commands.bench.cases", "fused": "ple.ops.fused", "ple": "ple"}
    found = _private_attributes(module, tree)
    assert {(t, n) for t, n, _ in found} == {
        ("ple.commands.bench.cases", "_dtype_name"),
        ("ple.ops.fused.native", "_lib"),
        ("ple.layout", "_x"),
    }


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
        private = [n for n in names if _is_private(n)]
        assert not private, f"{module}:{line} imports private name(s) {private} from {target}"
        outside = _private_package_outside(target, module)
        assert outside is None, f"{module}:{line} imports {target}: {outside} is private to its own folder"
    reads = [
        f"{module}:{line} reads private name {name} of {target}" for target, name, line in _private_attributes(module)
    ]
    assert not reads, "; ".join(reads)


def test_no_import_cycles():
    """No cycle, not even one closed by an annotations-only import (``if TYPE_CHECKING``)."""
    graph = {m: sorted({t for t, _, _ in _imports(m, annotations=True) if t in MODULES and t != m}) for m in MODULES}
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


def test_table_file_names_come_from_one_place():
    """A table file's name or suffix is spelled in code only where it is defined (``TABLE_SUFFIX``);
    everything else names table files through it or ``checkpoint.table_file_name``."""
    home = "ple.table.files.table_file"
    spelled = []
    for module, path in MODULES.items():
        if module == home:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"[\w*./{}-]*\.pletable", node.value):
                    spelled.append(f"{module}:{node.lineno} {node.value!r}")
    assert not spelled, "table file names spelled outside ple.table.files.table_file: " + "; ".join(spelled)


def test_architecture_map_lists_the_levels():
    """docs/ARCHITECTURE.md's map is this table: the same modules and folders at the same levels."""
    doc = (SRC.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    block = doc.split("```\nlevel  src/ple/\n", 1)[1].split("```", 1)[0]
    listed = {m.group(2): int(m.group(1)) for m in re.finditer(r"^(\d+)\s+(\S+)", block, re.MULTILINE)}

    def path(name: str) -> str:
        rel = name.removeprefix("ple").removeprefix(".").replace(".", "/")
        if name == "ple":
            return "__init__.py"
        return rel + "/" if name in PACKAGES else rel + ".py"

    assert listed == {path(name): level for name, level, _ in LEVELS}


def test_no_module_is_over_800_lines():
    """A module that grows past 800 lines is split along its seams (the rule in ARCHITECTURE.md)."""
    sizes = {p.relative_to(SRC).as_posix(): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    assert sizes and max(sizes.values()) > 100  # the walk found the package
    assert {name: n for name, n in sizes.items() if n > 800} == {}


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py"))


def test_the_package_root_and_table_stay_small():
    """Ideas live in folders: at most 8 modules at the package root, at most 8 entries at table/'s top."""
    root = [name for name in _entries(SRC) if name.endswith(".py")]
    assert len(root) <= 8, root
    table = _entries(SRC / "table")
    assert len(table) <= 8, table


def test_tests_mirror_the_package():
    """Every folder of tests/ names a package of src/ple (or benchmarks/, the scripts beside it), and every
    top-level package of src/ple has its folder of tests."""
    tests = Path(__file__).resolve().parent
    packages = {p.parent.relative_to(SRC).as_posix() for p in SRC.rglob("__init__.py")}
    folders = {
        p.relative_to(tests).as_posix()
        for p in tests.rglob("*")
        if p.is_dir() and p.name != "__pycache__" and any(p.glob("test_*.py"))
    }
    assert folders - packages - {"benchmarks"} == set()
    top = {name for name in packages if "/" not in name and name != "."}
    assert top - folders == set()


def test_architecture_names_every_folder():
    """docs/ARCHITECTURE.md names every folder of the package (as ``name/``) and those beside it."""
    doc = (SRC.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    folders = {p.name for p in SRC.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    assert {name for name in folders if f"{name}/" not in doc} == set()
    assert all(f"`{name}/`" in doc for name in ("benchmarks", "examples", "tests"))
