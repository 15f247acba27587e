"""Each package's ``__version__`` is the version its pyproject.toml declares (what pip and ``rl --version`` show)."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())


@pytest.mark.parametrize("name", PACKAGES)
def test_module_version_matches_the_pyproject(name):
    declared = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]["version"]
    module = importlib.import_module(name.replace("-", "_"))
    assert module.__version__ == declared, (f"{name}: __version__ {module.__version__!r} but pyproject.toml says "
                                            f"{declared!r}; bump both together (and the CHANGELOG)")
    changelog = (ROOT / "packages" / name / "CHANGELOG.md").read_text()
    assert f"## {declared}" in changelog, f"{name}: CHANGELOG.md has no entry for {declared}"
