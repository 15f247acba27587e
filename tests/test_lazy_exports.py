"""Packages whose names load on first use (PEP 562: ``_LAZY`` and ``__getattr__`` in ``__init__.py``) export
exactly what they declare: the ``_LAZY`` table, the ``if TYPE_CHECKING:`` imports (what type checkers and readers
see) and ``__all__`` name the same names, and each name resolves to the object its module defines. A name added to
one of the three and not the others would be missing for one kind of user.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAZY_PACKAGES = (
    "rl_algos",
    "rl_algos.losses",
    "rl_rollout",
    "rl_core",
    "rl_core.rl",
    "rl_core.trainers",
    "rl_core.data",
)


def _type_checking_imports(pkg: str) -> dict[str, str]:
    """name -> module of the ``from M import name`` lines under ``if TYPE_CHECKING:`` in the package's __init__."""
    mod = importlib.import_module(pkg)
    tree = ast.parse(Path(mod.__file__).read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.dump(imp)
                if imp.module != pkg:  # `from pkg import submodule`: the package's _SUBMODULES
                    out.update({a.asname or a.name: imp.module for a in imp.names})
    return out


@pytest.mark.parametrize("pkg", LAZY_PACKAGES)
def test_lazy_table_matches_type_checking_and_all(pkg):
    mod = importlib.import_module(pkg)
    assert _type_checking_imports(pkg) == mod._LAZY
    assert sorted(mod.__all__) == sorted([*mod._LAZY, *getattr(mod, "_SUBMODULES", ())])


@pytest.mark.parametrize("pkg", LAZY_PACKAGES)
def test_every_lazy_name_resolves_to_its_module_object(pkg):
    mod = importlib.import_module(pkg)
    for name, where in mod._LAZY.items():
        assert getattr(mod, name) is getattr(importlib.import_module(where), name), name
    for name in getattr(mod, "_SUBMODULES", ()):
        assert getattr(mod, name) is importlib.import_module(f"{pkg}.{name}"), name
    assert set(mod._LAZY) <= set(dir(mod))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        mod.not_a_name  # noqa: B018


def test_package_imports_load_no_torch():
    code = (
        "import sys, rl_algos, rl_algos.losses, rl_core, rl_core.rl, rl_core.trainers, rl_core.data, rl_rollout\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
