"""The import structure: the layers ``pyproject.toml`` declares (``[tool.tmac.layers]``, lowest first) are kept, and
no module imports itself back through others. Imports inside functions count too (they are dependencies all the
same); only ``if TYPE_CHECKING:`` blocks do not."""

import ast
import fnmatch
import os
import tomllib

import pytest

pytestmark = pytest.mark.unit  # needs no compiler (make unit)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _modules() -> dict[str, str]:
    """Module name → file, from the package directories ``pyproject.toml`` maps."""
    setup = _config()["tool"]["setuptools"]
    dirs = {p: setup["package-dir"].get(p, p.replace(".", "/")) for p in setup["packages"]}
    out = {}
    for package, d in dirs.items():
        for f in sorted(os.listdir(os.path.join(ROOT, d))):
            if f.endswith(".py"):
                out[package if f == "__init__.py" else f"{package}.{f[:-3]}"] = os.path.join(ROOT, d, f)
    return out


def _lazy_exports() -> dict[str, str]:
    """``tmac``'s lazy façade (``_LAZY`` in ``tmac/__init__.py``): a name → the module that defines it."""
    tree = ast.parse(open(os.path.join(ROOT, "tmac", "__init__.py")).read())
    return next(ast.literal_eval(node.value) for node in ast.walk(tree)
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets))


def _imports(name: str, path: str, modules: dict[str, str], lazy: dict[str, str] | None = None) -> set[str]:
    """The tmac modules ``name`` imports (``from X import y`` counts as X, and as X.y where that is a module). A
    name of the lazy façade counts as the module behind it: ``tmac.load_model`` (after ``import tmac``) and ``from
    tmac import Session`` are imports of ``tmac.models.files.load`` and ``tmac.models.run.generate``."""
    lazy = _lazy_exports() if lazy is None else lazy
    tree = ast.parse(open(path).read(), path)
    skip = set()
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` bodies are for type checkers only
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
            if base == "tmac":
                targets += [lazy[a.name] for a in node.names if a.name in lazy]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tmac" \
                and node.attr in lazy and name != "tmac":
            targets = [lazy[node.attr]]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _graph():
    modules, lazy = _modules(), _lazy_exports()
    return {name: _imports(name, path, modules, lazy) for name, path in modules.items()}


def _layer_of(name: str, layers: dict[str, list[str]]) -> int | None:
    return next((i for i, patterns in enumerate(layers.values()) if any(fnmatch.fnmatchcase(name, p) for p in patterns)),
                None)


def test_every_module_imports_only_its_own_layer_and_those_below():
    layers = _config()["tool"]["tmac"]["layers"]
    names = list(layers)
    graph = _graph()
    unplaced = sorted(m for m in graph if _layer_of(m, layers) is None)
    assert not unplaced, f"modules in no layer of pyproject.toml's [tool.tmac.layers]: {unplaced}"
    upward = sorted(f"{m} ({names[_layer_of(m, layers)]}) imports {d} ({names[_layer_of(d, layers)]})"
                    for m, deps in graph.items() for d in deps if _layer_of(d, layers) > _layer_of(m, layers))
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d):] + [m, d]) if d in path else f"{m} -> {d}")
            elif d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checks_see_function_level_imports_and_cycles(tmp_path):
    """The checker itself: an import inside a function is a dependency, a TYPE_CHECKING one is not."""
    modules = {"tmac.a": str(tmp_path / "a.py"), "tmac.b": str(tmp_path / "b.py")}
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
                                   "def f():\n    from .b import g\n")
    (tmp_path / "b.py").write_text("import os\n")
    assert _imports("tmac.a", modules["tmac.a"], modules) == {"tmac.b"}
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")
    assert _imports("tmac.a", modules["tmac.a"], modules) == set()


def test_the_checks_see_through_the_lazy_facade(tmp_path):
    """``tmac.load_model`` and ``from tmac import Session`` are imports of the modules behind the names."""
    modules = {"tmac": "", "tmac.a": str(tmp_path / "a.py"), "tmac.models.files.load": "", "tmac.models.run.generate": ""}
    lazy = {"load_model": "tmac.models.files.load", "Session": "tmac.models.run.generate"}
    (tmp_path / "a.py").write_text("import tmac\ndef f():\n    return tmac.load_model('x')\n")
    assert _imports("tmac.a", modules["tmac.a"], modules, lazy) == {"tmac", "tmac.models.files.load"}
    (tmp_path / "a.py").write_text("from tmac import Session\n")
    assert _imports("tmac.a", modules["tmac.a"], modules, lazy) == {"tmac", "tmac.models.run.generate"}
    assert _lazy_exports()["load_model"] == "tmac.models.files.load"
