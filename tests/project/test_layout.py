"""The package's shape, read from the code's own imports with `ast`.

* Every module imports on its own, in a fresh interpreter.
* The import graph of memfit's modules has no cycle. The graph holds EVERY import of a memfit module: at module
  level, under `if TYPE_CHECKING:`, and inside functions and methods (a lazy import defers the cost of loading a
  module; it does not remove the dependency). Relative imports are resolved, and `from package import name`
  is an import of the submodule `package.name` where one exists. The one way out is `LAZY_EXEMPT`: a lazy edge
  named there, with its reason, is left out of the cycle check and the layer check.
* No module imports from a layer above its own (`LAYERS`, bottom-up).
* No package's `__init__.py` exports a name that one of its submodules also has (importing the submodule would
  rebind the package attribute to the module).
* The README's "## Layout" section names every package.
* The tests mirror the package: each test file lives in tests/<folder>/, a folder named for a package of memfit or
  for one of the topics of `TEST_TOPICS`; bench/ holds only the test of bench/published.py.
"""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import memfit
from helpers import REPO_ROOT, TESTS_DIR

SRC = Path(memfit.__file__).parent
README = SRC.parents[1] / "README.md"


def _modules() -> list[str]:
    out = ["memfit"]
    for info in pkgutil.walk_packages([str(SRC)], prefix="memfit."):
        out.append(info.name)
    return sorted(out)


MODULES = _modules()


def _path(mod: str) -> Path:
    path = SRC.joinpath(*mod.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _is_package(mod: str) -> bool:
    return _path(mod).name == "__init__.py"


def test_every_module_is_listed():
    assert "memfit.allocator.snapshot" in MODULES and "memfit.fitting.run" in MODULES


@pytest.mark.slow
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_each_module_imports_on_its_own(order):
    """`python -c "import memfit.X"` for every X, each in a fresh interpreter.

    One interpreter runs each import in a subprocess-like isolation by clearing `sys.modules`
    of memfit between imports (torch stays loaded, which keeps this fast)."""
    mods = MODULES if order == "forward" else MODULES[::-1]
    code = (
        "import importlib, sys\n"
        f"mods = {mods!r}\n"
        "bad = []\n"
        "for m in mods:\n"
        "    for k in [k for k in sys.modules if k == 'memfit' or k.startswith('memfit.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


# -- the import graph ----------------------------------------------------------------------------------------
def _targets(mod: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The memfit modules that one import statement of `mod` loads (none for an upstream package)."""
    known = set(MODULES)

    def existing(name: str) -> str:  # `import memfit.a.b` names a module; a dotted tail past it is not one
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    if isinstance(node, ast.Import):
        return [existing(a.name) for a in node.names if a.name.split(".")[0] == "memfit"]
    if node.level:  # relative: from the package of `mod` (itself, when `mod` is a package), `level - 1` up
        base = mod.split(".") if _is_package(mod) else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        package = ".".join(base + ([node.module] if node.module else []))
    else:
        package = node.module or ""
    if package.split(".")[0] != "memfit":
        return []
    return [f"{package}.{a.name}" if f"{package}.{a.name}" in known else existing(package) for a in node.names]


def _edges() -> dict[tuple[str, str], list[tuple[int, bool]]]:
    """(importer, imported) -> [(line, lazy)] for every import of a memfit module by a memfit module;
    lazy: the statement is inside a function or method."""
    out: dict[tuple[str, str], list[tuple[int, bool]]] = {}

    def visit(mod: str, node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(mod, child):
                    if target != mod:
                        out.setdefault((mod, target), []).append((child.lineno, lazy))
            visit(mod, child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    for mod in MODULES:
        visit(mod, ast.parse(_path(mod).read_text(encoding="utf-8")), False)
    return out


EDGES = _edges()

#: Lazy imports (inside a function) left out of the cycle and layer checks, each with why it runs upward. Keep it
#: short: a cycle is broken by a leaf module or by passing a value, not by an entry here.
_VIEWS = ("a MemoryReport shows itself: timeline / to_html / plot and `_repr_html_` (Jupyter's display protocol is "
          "a method of the result) load the views (memfit.report, above the estimate) when called")
LAZY_EXEMPT: dict[tuple[str, str], str] = {
    ("memfit.estimator", "memfit.report"): _VIEWS,
    ("memfit.estimator", "memfit.report.html"): _VIEWS,
}


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """One cycle path [a, b, ..., a] per strongly connected component of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    out = []
    for component in components:  # a shortest way back to the component's first module
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in [w for v in frontier for w in graph.get(v, [])]:
            nxt = []
            for v in frontier:
                for w in graph.get(v, []):
                    if w in component and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph.get(v, []))
        out.append(paths[last] + [start])
    return out


def _describe(path: list[str], edges: set[tuple[str, str]]) -> str:
    """The cycle `path`, then every other import that ties its strongly connected component."""
    members = _component(path[0], edges)
    steps = []
    for a, b in zip(path, path[1:]):
        where = ", ".join(f"{'lazy ' if lazy else ''}line {line}" for line, lazy in sorted(set(EDGES[(a, b)])))
        steps.append(f"{a} -> {b} ({_path(a).relative_to(SRC.parent)}: {where})")
    on_path = set(zip(path, path[1:]))
    more = sorted(f"{a} -> {b}" for a, b in edges if a in members and b in members and (a, b) not in on_path)
    return "\n  ".join(steps + ([f"also tied by: {', '.join(more)}"] if more else []))


def _component(start: str, edges: set[tuple[str, str]]) -> set[str]:
    """The modules that reach `start` and that `start` reaches."""
    def reach(forward: bool) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            v = todo.pop()
            for a, b in edges:
                w = b if forward and a == v else a if not forward and b == v else None
                if w is not None and w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen
    return reach(True) & reach(False)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c", "a"]]
    assert _cycles({("a", "b"), ("b", "c")}) == []


def test_the_graph_reads_every_kind_of_import():
    lazy = [key for key, sites in EDGES.items() if any(is_lazy for _, is_lazy in sites)]
    assert len(lazy) > 50, "imports inside functions are part of the graph"
    tree = ast.parse("from . import tracker\nfrom ..models import build\nfrom memfit.sim import engine, cuda_patches\n")
    got = [_targets("memfit.sim.engine", node) for node in tree.body]
    assert got == [["memfit.sim.tracker"], ["memfit.models.build"], ["memfit.sim.engine", "memfit.sim.cuda_patches"]]


def test_no_import_cycle():
    for edge, why in LAZY_EXEMPT.items():
        assert edge in EDGES, f"LAZY_EXEMPT names `{edge[0]} -> {edge[1]}`, which no import makes; remove it"
        assert all(lazy for _, lazy in EDGES[edge]), f"`{edge[0]} -> {edge[1]}` is imported at module level"
        assert why, edge
    edges = set(EDGES) - set(LAZY_EXEMPT)
    cycles = _cycles(edges)
    assert not cycles, "import cycles (importer -> imported):\n  " + "\n\n  ".join(_describe(c, edges) for c in cycles)


# -- the layers ----------------------------------------------------------------------------------------------
#: Bottom-up: a module may import from its own layer or any layer below it. A name is a top-level module or
#: package of memfit (a package's modules are in its layer); "memfit" is the package's own `__init__.py`.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundation", {"errors", "units", "trace", "files", "collector", "oom_text", "progress", "_version"}),
    ("the run", {"train_setup"}),
    ("what memfit knows", {"models", "gpus", "allocator", "inputs"}),  # inputs: data lengths, padding, packing
    ("from a trace and a model", {"peaks", "cache"}),  # cache: keyed by the model's config (models.catalog)
    ("the simulator", {"sim"}),
    ("per rank", {"parallel"}),
    ("remedies", {"remedies"}),
    ("estimate", {"estimator"}),
    ("plan", {"planner"}),
    ("diagnose", {"diagnosis"}),  # diagnose's advice is checked by a plan
    ("views of the results", {"report"}),  # timeline, html, plot of a MemoryReport / PlanResult / Diagnosis
    ("an emulated GPU", {"testing"}),  # fitting runs under testing.memory_budget
    ("fit", {"fitting"}),
    # process: main (parse, run the verb), run_here, finish_process; server: `memfit serve` (runs a verb in a
    # child through process.run_here); commands/serve.py starts it
    # ui: the web app, which runs the CLI's verbs (memfit.process.main) on the command line its form makes
    ("the command line", {"commands", "process", "server", "ui"}),
    ("the console script", {"cli"}),  # cli.entry: a served child or this process, then the fast exit
    ("the faces", {"__main__", "memfit"}),  # `python -m memfit`; the public face of `import memfit`
]


def _layer(mod: str) -> int:
    top = mod.split(".")[1] if "." in mod else mod
    for i, (_, names) in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"module `{mod}` is in no layer of tests/project/test_layout.py LAYERS; add it")


def test_each_module_is_in_exactly_one_layer():
    names = [n for _, layer in LAYERS for n in layer]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    tops = {m.split(".")[1] if "." in m else m for m in MODULES}
    assert not set(names) - tops, f"LAYERS names modules that do not exist: {sorted(set(names) - tops)}"
    for mod in MODULES:
        _layer(mod)


def test_no_import_from_a_higher_layer():
    bad = sorted(f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]}) at "
                 f"{', '.join(f'{_path(a).relative_to(SRC.parent)}:{line}' for line, _ in sorted(set(sites)))}"
                 for (a, b), sites in EDGES.items() if _layer(b) > _layer(a) and (a, b) not in LAZY_EXEMPT)
    assert not bad, "imports from a higher layer:\n  " + "\n  ".join(bad)


# -- packages ------------------------------------------------------------------------------------------------
def _exports(init: Path) -> list[str]:
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def test_no_package_exports_the_name_of_its_own_submodule():
    """`memfit.fitting.preflight` as a function and as a module: `import memfit.fitting.<module>` rebinds the
    package attribute to the module, and `from memfit.fitting import <name>` then gives either."""
    bad = []
    for pkg in (m for m in MODULES if _is_package(m)):
        subs = {m.rsplit(".", 1)[1] for m in MODULES if m.rsplit(".", 1)[0] == pkg and m != pkg}
        bad += [f"{pkg}.{name}" for name in _exports(_path(pkg)) if name in subs]
    assert not bad, f"exported names that are also submodules: {bad}"


def test_the_readme_layout_names_every_package():
    text = README.read_text(encoding="utf-8")
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"{README.name} has no `## Layout` section"
    section = match.group(1)
    packages = sorted(m.split(".", 1)[1] for m in MODULES if _is_package(m) and m.count(".") == 1)
    missing = [p for p in packages if not re.search(rf"(?<![\w/]){re.escape(p)}/", section)]
    assert not missing, f"the README's Layout section does not name the packages {missing} (as `name/`)"


# -- the public face and the tests ---------------------------------------------------------------------------
def test_public_face_is_complete_and_lazy():
    code = ("import sys, memfit\n"
            "assert 'torch' not in sys.modules, 'import memfit must not import torch'\n"
            "for name in memfit.__all__:\n"
            "    assert getattr(memfit, name) is not None, name\n"
            "from memfit.errors import MemfitError\n"
            "assert memfit.MemfitError is MemfitError\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_test_file_imports_another():
    """Shared test code lives in tests/helpers.py and tests/conftest.py, never in a test_*.py."""
    bad = []
    for path in _test_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{path.name} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not bad, bad


#: Folders of tests/ that are not named for a package of memfit: what their tests cover.
TEST_TOPICS = {
    "cache": "memfit.cache: estimates and plans read back from disk",
    "cli": "the command line as a whole: cli.py, process.py (and the paused collector), server.py, files.py",
    "estimator": "memfit.estimate's report (estimator.py, peaks.py)",
    "oom": "OOM messages: oom_text.py and the CPU OOM of testing.py",
    "train_setup": "train_setup.py: TrainSetup and its readers",
    "project": "the repository as a whole: this layout, the README and docs/",
}
#: The test files outside tests/: a bench script's test lives with the script it loads.
BENCH_TESTS = ["test_published.py", "test_published_liger.py"]


def _test_files() -> list[Path]:
    return sorted(TESTS_DIR.rglob("test_*.py")) + [REPO_ROOT / "bench" / name for name in BENCH_TESTS]


def test_test_files_live_in_a_folder_per_package_or_topic():
    packages = {m.split(".")[1] for m in MODULES if _is_package(m) and m.count(".") == 1}
    assert not packages & set(TEST_TOPICS), "a topic folder is named like a package"
    bad = []
    for path in sorted(TESTS_DIR.rglob("test_*.py")):
        parts = path.relative_to(TESTS_DIR).parts
        if len(parts) != 2:
            bad.append(f"{path.relative_to(REPO_ROOT)}: not in a folder of tests/ (tests/<package or topic>/)")
        elif parts[0] not in packages | set(TEST_TOPICS):
            bad.append(f"{path.relative_to(REPO_ROOT)}: `{parts[0]}` is neither a package of memfit "
                       f"{sorted(packages)} nor a topic of TEST_TOPICS (tests/project/test_layout.py)")
    assert not bad, "\n".join(bad)
    bench = sorted(p.name for p in (REPO_ROOT / "bench").rglob("*.py") if p.name.startswith("test_")
                   or p.name.endswith("_test.py"))
    assert bench == BENCH_TESTS, f"bench/ holds test files {bench}; tests of memfit go in tests/<package or topic>/"


def test_test_file_names_are_unique_and_folders_hold_no_init():
    """pytest imports each test file by its basename (rootdir, prepend mode, no __init__.py): two files of one
    name in two folders would collide."""
    seen: dict[str, list[str]] = {}
    for path in _test_files():
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO_ROOT)))
    assert not [v for v in seen.values() if len(v) > 1], [v for v in seen.values() if len(v) > 1]
    inits = sorted(str(p.relative_to(REPO_ROOT)) for p in TESTS_DIR.rglob("__init__.py"))
    assert not inits, f"test folders are not packages: {inits}"
