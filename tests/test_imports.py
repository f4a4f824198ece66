"""The repository's modules import each other without a cycle: the graph of imports among the top-level modules (and
the modules of top-level packages), read with `ast` from every `import` and `from ... import` anywhere in a file
(function-local and `if TYPE_CHECKING:` ones included), is acyclic, and docs/MODULES.md lists each module's imports
and layer as they are. Every module keeps its docstrings short (at most 20% of its code lines, module docstrings at most
12 lines). Nothing is imported; tests/ is not part of the graph.

Run: `pytest tests/test_imports.py` (pure Python, well under a second).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"tests", "assets", "docs", "configs", "data", "slurm"}


def repository_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file: every *.py at the top level, and every *.py inside a top-level package (a folder
    with __init__.py, e.g. a bench/ package), its __init__.py as the package itself."""
    modules = {p.stem: p for p in root.glob("*.py")}
    for pkg in sorted(d for d in root.iterdir() if d.is_dir() and (d / "__init__.py").is_file()):
        if pkg.name in SKIP_DIRS or pkg.name.startswith("."):
            continue
        for p in sorted(pkg.rglob("*.py")):
            parts = p.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return modules


def imported_names(path: Path, module: str) -> set[str]:
    """The dotted names `path` imports (absolute; relative imports resolved against `module`), with for `from X import
    a` both X and X.a (a may be a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the repository modules it imports (an import of a.b.c counts for a.b.c, a.b and a, the ones that
    exist; a module's own package is not an edge)."""
    modules = repository_modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(path, name):
            parts = imported.split(".")
            targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
        graph[name] = {t for t in targets if t != name and not name.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, modules in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_repository_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    assert {"train", "pack", "backend.shared_prompt", "backend.mamba_torch"} <= graph.keys()
    assert "pack" in graph["train"]  # the graph sees the imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_local_and_type_checking_imports(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import x\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n")
    (tmp_path / "d.py").write_text("import os\nimport a\n")
    pkg = tmp_path / "bench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .runs import go\n")
    (pkg / "runs.py").write_text("import d\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "bench": {"bench.runs"}, "bench.runs": {"d"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(tmp_path)) is None


def _modules_md_entries() -> dict[str, str]:
    """docs/MODULES.md: entry name (`pack`, `bench`) -> the entry's text (from its `- **`name`**` line to the next)."""
    text = (ROOT / "docs" / "MODULES.md").read_text()
    heads = list(re.finditer(r"^- \*\*`([\w/.]+?)(?:\.py|/)`\*\*", text, re.M))
    ends = [m.start() for m in heads[1:]] + [len(text)]
    return {m.group(1).replace("/", "."): text[m.start():end] for m, end in zip(heads, ends, strict=True)}


def test_docs_modules_lists_every_module_with_its_imports_and_layer():
    """docs/MODULES.md's "Imports:" line of each entry is the entry's import graph, and its layer list puts every
    import below (or earlier in the same layer). An entry is a module (`pack.py`, `backend/local_spec.py`) or a
    package as a whole (`bench/`: what its modules import outside it); names are written with "/" (backend/local_spec),
    and `from backend import local_spec` lists backend/local_spec, not also the package."""
    graph, entries = import_graph(), _modules_md_entries()
    unit = lambda m: m if m in entries else m.split(".")[0]  # noqa: E731
    units = {unit(m) for m in graph}
    assert units <= entries.keys(), f"docs/MODULES.md has no entry for {sorted(units - entries.keys())}"
    imports = {name: set() for name in units}
    for m, targets in graph.items():
        imports[unit(m)].update(unit(t) for t in targets)
    for name in sorted(units):
        wanted = {t for t in imports[name] if not any(o.startswith(t + ".") for o in imports[name])} - {name}
        line = re.search(r"Imports: (.*?)\.(?:\n(?!  )|\Z)", entries[name], re.S)
        assert line, f"docs/MODULES.md: {name} has no 'Imports:' line"
        listed = set() if line.group(1) == "none" else {
            m.strip().replace("/", ".") for m in line.group(1).replace("\n", " ").split(",")}
        assert listed == wanted, f"docs/MODULES.md: {name} imports {sorted(wanted)}, listed {sorted(listed)}"
    text = (ROOT / "docs" / "MODULES.md").read_text()
    layers = [re.findall(r"`([\w/]+)`", m.group(1)) for m in re.finditer(r"^\d+\. (.*(?:\n   .*)*)$", text, re.M)]
    order = [m.strip("/").replace("/", ".") for layer in layers for m in layer]
    assert units <= set(order), f"docs/MODULES.md's layers miss {sorted(units - set(order))}"
    for name in units:
        for imported in imports[name] - {name}:
            assert order.index(imported) < order.index(name), f"{name} imports {imported}, listed above it"


def test_every_module_stays_readable_in_one_sitting():
    """No repository module (bench/'s included) grows past 800 lines: a larger one is split along a seam."""
    long = {name: n for name, path in repository_modules().items() if (n := len(path.read_text().splitlines())) > 800}
    assert not long, f"modules over 800 lines: {long}"


def docstring_and_code_lines(path: Path) -> tuple[int, int, int]:
    """(docstring lines, code lines, module docstring lines) of one file. Docstring lines: the lines spanned by the
    docstrings (a string literal as the first statement) of the module, its classes and its functions. Code lines:
    every other line that is neither blank nor only a comment."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    docs: set[int] = set()
    module_doc = 0
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            docs.update(range(first.lineno, first.end_lineno + 1))
            if isinstance(node, ast.Module):
                module_doc = first.end_lineno - first.lineno + 1
    code = sum(1 for i, line in enumerate(source.splitlines(), start=1)
               if line.strip() and not line.lstrip().startswith("#") and i not in docs)
    return len(docs), code, module_doc


def test_docstring_and_code_lines_counts_by_its_definition(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text('"""Two\nlines."""\n\n# a comment\nimport os\n\n\nclass A:\n    """One."""\n\n    def f(self):\n'
                      '        """One more."""\n        return os.sep  # a comment after code\n')
    assert docstring_and_code_lines(sample) == (4, 4, 2)  # import, class, def, return


def test_docstrings_say_what_in_a_fifth_of_the_code():
    """Every repository module's docstring lines are at most 20% of its code lines (docstring_and_code_lines), and its
    module docstring is at most 12 lines: details and history live in docs/DESIGN.md. A module of under 25 code lines
    (a package's __init__.py that describes its folder, bench/__main__.py) is held to the 12 lines alone."""
    too_long, too_many = {}, {}
    for name, path in repository_modules().items():
        docs, code, module_doc = docstring_and_code_lines(path)
        if module_doc > 12:
            too_long[name] = module_doc
        if code >= 25 and docs > 0.2 * code:
            too_many[name] = f"{docs} docstring lines, {code} code lines"
    assert not too_long, f"module docstrings over 12 lines: {too_long}"
    assert not too_many, f"docstrings over 20% of the code: {too_many}"
