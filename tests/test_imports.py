"""The layout's rules, read from every `import` line (those inside functions included).

Pure Python (`ast`, no torch): the scheduler stays free of the device and of the search,
the cost model sits below everything, imports point down the data path (no cycle between
modules), and no folder or file outgrows what a reader can take in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vlmserve", "encoders", "kernels", "scheduler", "search")
FOLDERS = (*PACKAGES, "benchmarks", "docs", "tests")
MAX_MODULES_PER_FOLDER = 15
MAX_LINES_PER_FILE = 450
NOT_COUNTED = {"__init__.py", "conftest.py"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if ".venv" not in path.parts:
                modules[_module_name(path)] = path
    return modules


MODULES = _project_modules()


def _imported_names(path: Path) -> list[str]:
    """Every dotted name an `import` in the file reaches (relative ones resolved); for
    `from pkg import name`, `pkg.name` where that is a module, else `pkg`. Imports under
    `if TYPE_CHECKING:` are left out: they never run (annotations only), so they neither
    load a module nor close a cycle; every other import counts, function-level ones too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    this = _module_name(path)
    is_package = path.name == "__init__.py"
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    names = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = this.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                names.append(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return names


def _project_edges(module: str) -> set[str]:
    """The project modules `module` imports (a dotted name resolved to its longest module
    prefix)."""
    edges = set()
    for name in _imported_names(MODULES[module]):
        parts = name.split(".")
        while parts and ".".join(parts) not in MODULES:
            parts.pop()
        if parts and ".".join(parts) != module:
            edges.add(".".join(parts))
    return edges


def _top_level_imports(module: str) -> set[str]:
    return {name.split(".")[0] for name in _imported_names(MODULES[module])}


def test_the_scheduler_imports_no_torch_search_or_vlmserve():
    bad = {
        module: sorted(_top_level_imports(module) & {"torch", "search", "vlmserve"})
        for module in MODULES
        if module.split(".")[0] == "scheduler"
    }
    assert not {m: b for m, b in bad.items() if b}


def test_the_cost_model_imports_nothing_from_the_project():
    bad = {}
    for module in MODULES:
        if not module.startswith("search.costmodel"):
            continue
        outside = sorted(
            target for target in _project_edges(module) if not target.startswith("search.costmodel")
        )
        if outside:
            bad[module] = outside
    assert not bad


def _tangles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's import cycles: its strongly connected components of more than one module
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    tangles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                    tangles.append(sorted(component))
    return sorted(tangles)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    assert _tangles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert _tangles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_between_modules():
    graph = {module: _project_edges(module) for module in MODULES}
    assert _tangles(graph) == []


def _folders() -> list[Path]:
    folders = []
    for top in FOLDERS:
        for folder in [ROOT / top, *sorted((ROOT / top).rglob("*"))]:
            if folder.is_dir() and "__pycache__" not in folder.parts:
                folders.append(folder)
    return folders


def _folder_case(folder: Path):
    return pytest.param(folder, id=str(folder.relative_to(ROOT)))


@pytest.mark.parametrize("folder", [_folder_case(f) for f in _folders()])
def test_no_folder_holds_more_than_15_modules(folder):
    modules = [p.name for p in folder.glob("*.py") if p.name not in NOT_COUNTED]
    assert len(modules) <= MAX_MODULES_PER_FOLDER, sorted(modules)


def test_no_file_over_450_lines():
    long_files = {}
    for top in FOLDERS:
        for path in (ROOT / top).rglob("*.py"):
            n_lines = len(path.read_text().splitlines())
            if n_lines > MAX_LINES_PER_FILE:
                long_files[str(path.relative_to(ROOT))] = n_lines
    assert not long_files


def test_type_checking_imports_are_left_out_and_function_level_ones_count():
    # core.py imports request_options at module level; request_options names Engine for
    # its annotations only, under TYPE_CHECKING; the runner imports lazily in functions.
    assert "vlmserve.engine.request_options" in _project_edges("vlmserve.engine.core")
    assert "vlmserve.engine.core" not in _project_edges("vlmserve.engine.request_options")
    assert "TYPE_CHECKING" in MODULES["vlmserve.engine.request_options"].read_text()
    assert "vlmserve.sample.grammar" in _project_edges("vlmserve.engine.grammars")  # in a method
