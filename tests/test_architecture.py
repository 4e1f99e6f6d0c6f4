"""The layout docs/architecture.md describes is the one in src/grpo: every module it names
exists and every module is named there; the folders import each other without a circle and
only down the page's list of layers; the
device layers (cpu/, cuda/) are reached only through the backends; each folder says its one
job; and no docstring quotes a timing (measurements live in docs/performance.md, with their
machine)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "grpo"
PAGE = ROOT / "docs" / "architecture.md"


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module under src/grpo."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The grpo modules `path` imports (anywhere in it, lazily too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "grpo"
            and node.level == 0
        ):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "grpo"}
    return found


def _folder(module: str) -> str:
    parts = module.split(".")
    folder = parts[1] if len(parts) > 1 else parts[0]
    # one layer, as the page lists it: the registry names the parts the config chooses
    return "config" if folder == "registry" else folder


def test_the_page_names_every_module_and_only_modules_that_exist():
    page = PAGE.read_text()
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", page))
    files = {
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    missing = sorted(files - named)
    assert not missing, f"docs/architecture.md does not name {missing}"
    stale = sorted(n for n in named if not (SRC / n).is_file() and not (ROOT / n).is_file())
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"


def test_folders_import_each_other_without_a_circle():
    modules = _modules()
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        for target in _imports(path, modules):
            a, b = _folder(name), _folder(target)
            if a != b and b != "grpo":
                edges.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    circles = sorted(
        f"{a} -> {b}" for a, targets in edges.items() for b in targets if reaches(b, a, {b})
    )
    assert not circles, f"folders that import each other in a circle: {circles}"


def _module_cycles(folder: str) -> list[list[str]]:
    """Import cycles among the modules of one folder, every import counted (lazy ones and those
    under TYPE_CHECKING too: a cycle a type checker follows is still a tangle to a reader)."""
    modules = _modules()
    inside = {name: path for name, path in modules.items() if _folder(name) == folder}
    edges = {
        name: {t for t in _imports(path, modules) if t in inside and t != name}
        for name, path in inside.items()
    }
    cycles, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(edges[node]):
            if nxt in path:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    for name in sorted(inside):
        if name not in done:
            visit(name, [name])
    return cycles


def test_training_and_config_modules_import_each_other_without_a_circle():
    for folder in ("training", "config"):
        cycles = _module_cycles(folder)
        assert not cycles, f"{folder}/ has import cycles: {[' -> '.join(c) for c in cycles]}"


def test_the_module_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: two modules of a folder written to import each other."""
    package = tmp_path / "grpo" / "loop"
    package.mkdir(parents=True)
    (package / "a.py").write_text("from grpo.loop.b import x\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo.loop.a import y\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "grpo")
    assert _module_cycles("loop") == [["grpo.loop.a", "grpo.loop.b", "grpo.loop.a"]]


def test_only_the_backends_reach_the_device_layers():
    modules = _modules()
    # the backends choose the device layer (grpo.backends.device_layer), huge pages included
    allowed = {"grpo.backends.device_layer"}
    layers = {"cpu", "cuda"}
    reaching = sorted(
        name
        for name, path in modules.items()
        if _folder(name) not in layers
        and any(_folder(t) in layers for t in _imports(path, modules))
        and name not in allowed
    )
    assert not reaching, (
        f"modules outside the backends that import grpo.cpu or grpo.cuda: {reaching}"
    )


def _layers() -> list[set[str]]:
    """The page's list of layers, top to bottom: each line's folders and programs (`cli.py`,
    `trl/`, `registry.py`), as the names `_folder` gives their modules."""
    block = PAGE.read_text().split("## The layers", 1)[1].split("```", 2)[1]
    layers = []
    for line in block.strip().splitlines():
        names = line.split("  ", 1)[0]
        layers.append({n.strip().removesuffix("/").removesuffix(".py") for n in names.split(",")})
    return layers


def _upward_imports(layers: list[set[str]]) -> list[str]:
    """The imports that go from a layer to one listed above it."""
    rank = {name: i for i, names in enumerate(layers) for name in names}
    modules = _modules()
    return sorted(
        f"{name} -> {target}"
        for name, path in modules.items()
        if _folder(name) in rank
        for target in _imports(path, modules)
        if _folder(target) in rank and rank[_folder(target)] < rank[_folder(name)]
    )


def test_imports_run_down_the_documented_layers():
    """A module imports only its own layer's modules and those listed below it: the page's
    order is the code's."""
    layers = _layers()
    listed = set().union(*layers)
    folders = {_folder(name) for name in _modules()} - {"grpo", "__main__"}
    unlisted = sorted(folders - listed)
    assert not unlisted, f"docs/architecture.md's layer list does not name {unlisted}"
    upward = _upward_imports(layers)
    assert not upward, f"imports that go up docs/architecture.md's layer list: {upward}"


def test_the_order_check_sees_an_upward_import():
    """Listed bottom to top, the layers' imports all go up: the check is not vacuous."""
    upward = _upward_imports(list(reversed(_layers())))
    assert any(line.startswith("grpo.training.") for line in upward)


def test_each_folder_says_its_one_job_and_the_top_level_stays_small():
    for init in SRC.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), (
            f"{init.relative_to(ROOT)} has no docstring"
        )
    top = [
        p.name
        for p in SRC.iterdir()
        if p.name not in ("__pycache__",) and (p.suffix == ".py" or p.is_dir())
    ]
    # the layers of docs/architecture.md (cpu/ and cuda/ beside each other, health/) and the programs
    # (cli.py, trl/, serve/)
    assert len(top) <= 19, f"src/grpo has {len(top)} top-level names: {sorted(top)}"


TIMING = re.compile(r"\b\d+\.\d+\s?s\b|\b\d+(?:\.\d+)?\s?(?:ms|us|µs|GB/s|GFLOP/s|MB/s)(?!\w)")


def _docstrings(tree: ast.AST):
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:  # module, class and function docstrings, and attribute docstrings
                if (
                    isinstance(stmt, ast.Expr)
                    and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)
                ):
                    yield stmt.lineno, stmt.value.value


def test_no_docstring_quotes_a_timing():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for line, text in _docstrings(ast.parse(path.read_text())):
            for match in TIMING.finditer(text):
                found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}")
    assert not found, (
        "docstrings quoting timings (move them to docs/performance.md):\n" + "\n".join(found)
    )
