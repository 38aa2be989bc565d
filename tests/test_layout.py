"""The package's shape: every module imports on its own, in a fresh interpreter (no import cycle),
and no module imports from a layer above its own (issue 11)."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import memfit

SRC = Path(memfit.__file__).parent


def _modules() -> list[str]:
    out = ["memfit"]
    for info in pkgutil.walk_packages([str(SRC)], prefix="memfit."):
        out.append(info.name)
    return sorted(out)


MODULES = _modules()


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


# Layers, bottom-up: a module may import from its own layer or any layer below it.
LAYERS = [
    {"errors", "units", "trace", "oom_text", "files", "collector"},  # collector: issue 15 speed
    {"train_setup", "models", "gpus", "allocator", "peaks", "cache"},  # TrainSetup asks models for the default task
    {"sim", "remedies"},  # sim.trl_steps + sim._trl_adapter (TRL, issue 13: the one module on TRL internals)
    {"estimator", "parallel"},  # parallel: per-rank multi-GPU estimates (issue 14); estimator calls it
    {"planner"},
    {"diagnosis"},
    {"fitting", "testing"},  # fitting.callback (MemfitCallback), fitting.trl_data (issue 13); fitting.engines (issue 14)
    {"cli", "commands", "__main__", "server"},  # server: `memfit serve` (issue 15); __main__: `python -m memfit`; commands.train_trl: train --trainer (issue 13)
]


def _layer(mod: str) -> int:
    top = mod.split(".")[1] if mod.count(".") >= 1 else mod
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"module `{mod}` is in no layer of tests/test_layout.py")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memfit."):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("memfit."))
    return out


@pytest.mark.parametrize("mod", [m for m in MODULES if m != "memfit"])
def test_no_import_from_a_higher_layer(mod):
    path = SRC.joinpath(*mod.split(".")[1:])
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    own = _layer(mod)
    above = sorted(m for m in _imports(path) if _layer(m) > own)
    assert not above, f"`{mod}` (layer {own}) imports from higher layers: {above}"


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
    tests = Path(__file__).parent
    bad = []
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{path.name} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not bad, bad
