"""Check the built distributions in a folder (``uv build --all-packages -o dist``) against the packages' sources.

For every package under ``packages/``: exactly one wheel and one sdist of the pyproject's name and version; the
wheel's METADATA carries that name and version, the README as its long description, and exactly the pyproject's
dependencies and extras (nothing the workspace adds, such as ``workspace = true`` sources, leaks in); the wheel
holds the package's modules and no tests; the sdist holds the pyproject, README, CHANGELOG and sources.

    python scripts/check_dists.py dist

Exits 1 listing every problem. Run by ``scripts/wheels-check.sh`` (and so by ``.ci/run``).
"""

from __future__ import annotations

import email
import re
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement  # transformers needs packaging, so every venv here has it

ROOT = Path(__file__).resolve().parents[1]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _req_key(req: str) -> str:
    """A requirement as ``packaging`` prints it (specifiers sorted), comparable across pyproject and METADATA."""
    return str(Requirement(req)).replace('"', "'").lower()


def check(dist: Path) -> list[str]:
    problems: list[str] = []
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        name, version = project["name"], project["version"]
        stem = f"{_norm(name)}-{version}"
        wheels = sorted(dist.glob(f"{stem}-*.whl"))
        sdists = sorted(dist.glob(f"{stem}.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            problems.append(f"{name} {version}: want one wheel and one sdist in {dist}, found {wheels + sdists}")
            continue
        src = pyproject.parent / "src"
        modules = sorted(p.name for p in src.iterdir() if (p / "__init__.py").is_file())
        with zipfile.ZipFile(wheels[0]) as whl:
            files = whl.namelist()
            meta_path = next((f for f in files if f.endswith(".dist-info/METADATA")), None)
            if meta_path is None:
                problems.append(f"{wheels[0].name}: no METADATA")
                continue
            meta = email.message_from_bytes(whl.read(meta_path))
        if (meta["Name"], meta["Version"]) != (name, version):
            problems.append(
                f"{wheels[0].name}: METADATA says {meta['Name']} {meta['Version']}, pyproject {name} {version}"
            )
        if meta.get("Description-Content-Type", "").split(";")[0] != "text/markdown" or len(meta.get_payload()) < 200:
            problems.append(f"{wheels[0].name}: the README is not its long description (text/markdown)")
        want = {_req_key(r) for r in project.get("dependencies", [])}
        for extra, reqs in project.get("optional-dependencies", {}).items():
            want |= {_req_key(f"{r}; extra == '{extra}'") if ";" not in r else _req_key(r) for r in reqs}
        got = {_req_key(r) for r in meta.get_all("Requires-Dist") or []}
        if want != got:
            problems.append(
                f"{wheels[0].name}: Requires-Dist differs from pyproject: missing {sorted(want - got)}, "
                f"extra {sorted(got - want)}"
            )
        extras = set(project.get("optional-dependencies", {}))
        if set(meta.get_all("Provides-Extra") or []) != extras:
            problems.append(
                f"{wheels[0].name}: Provides-Extra {meta.get_all('Provides-Extra')}, pyproject {sorted(extras)}"
            )
        for mod in modules:
            if f"{mod}/__init__.py" not in files:
                problems.append(f"{wheels[0].name}: no {mod}/__init__.py in the wheel")
        if any("/tests/" in f or f.startswith("tests/") for f in files):
            problems.append(f"{wheels[0].name}: ships tests")
        with tarfile.open(sdists[0]) as sd:
            names = {n.split("/", 1)[1] for n in sd.getnames() if "/" in n}
        for needed in ("pyproject.toml", "README.md", "CHANGELOG.md", *(f"src/{m}/__init__.py" for m in modules)):
            if needed not in names:
                problems.append(f"{sdists[0].name}: no {needed}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python scripts/check_dists.py DIST_FOLDER", file=sys.stderr)
        return 2
    problems = check(Path(argv[0]))
    for p in problems:
        print(f"FAIL: {p}")
    if not problems:
        print(f"distributions in {argv[0]}: every package's wheel and sdist match its pyproject")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
