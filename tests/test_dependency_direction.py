"""The dependency direction of DESIGN.md, checked by walking every import of every package.

For each package under packages/*/src, every imported top-level module must be
stdlib, the package itself, or in its allowed list below (DESIGN.md's graph); and
every third-party import must be declared in that package's pyproject.toml, so an
undeclared dependency fails here before it fails a user. rl-core must never import
Ray or rl-placement; rl-algos imports torch only.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# import name -> distribution name, where they differ
DIST_OF = {"yaml": "pyyaml", "PIL": "pillow", "rl_algos": "rl-algos", "rl_rollout": "rl-rollout",
           "rl_placement": "rl-placement", "rl_core": "rl-core", "rl_cli": "rl-stack-cli"}

# DESIGN.md: what each package may import (besides stdlib and itself).
ALLOWED = {
    "rl_algos": {"torch", "triton"},  # triton: torch's CUDA wheels bring it; only losses/logits_triton.py, lazily
    "rl_rollout": {"torch", "transformers", "tokenizers", "msgpack", "safetensors", "numpy", "vllm", "PIL", "math_verify",
                   "uvicorn", "h11", "starlette", "httpx"},  # the reward server and client (rewards/server_app, remote)
    "rl_placement": {"ray"},
    "rl_core": {"rl_algos", "rl_rollout", "torch", "transformers", "deepspeed", "safetensors", "msgpack", "peft",
                "datasets", "pyarrow", "tensorboard", "matplotlib", "yaml", "tqdm", "numpy", "wandb", "flash_attn",
                "huggingface_hub", "liger_kernel", "mlflow",
                "bitsandbytes"},  # --load_in_4bit (rl_core.qlora), the qlora extra, imported lazily
    "rl_cli": {"rl_algos", "rl_rollout", "rl_placement", "rl_core", "ray", "torch", "transformers", "yaml", "packaging",
               "deepspeed", "msgpack", "safetensors", "numpy", "vllm",
               "matplotlib", "tqdm"},  # rl eval's chart and progress bar, each skipped when absent (find_spec)
}
# Optional imports (guarded by try/except ImportError, or an extra): allowed without a
# hard dependency, but they must still be in ALLOWED.
OPTIONAL = {"vllm", "wandb", "mlflow", "flash_attn", "triton", "liger_kernel", "PIL", "matplotlib", "tqdm",
            "bitsandbytes"}
FORBIDDEN = {"rl_core": {"ray", "rl_placement"}, "rl_algos": {"numpy"}}


def imports_of(py: Path) -> set[str]:
    tree = ast.parse(py.read_text(), filename=str(py))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def declared(pkg_dir: Path) -> set[str]:
    meta = tomllib.loads((pkg_dir / "pyproject.toml").read_text())["project"]
    deps = list(meta.get("dependencies", []))
    for extra in meta.get("optional-dependencies", {}).values():
        deps += extra
    return {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}


PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


def test_every_package_is_covered():
    names = {next((p / "src").iterdir()).name for p in PACKAGES}
    assert names == set(ALLOWED), f"packages on disk {sorted(names)} vs rules for {sorted(ALLOWED)}"


@pytest.mark.parametrize("pkg_dir", PACKAGES, ids=lambda p: p.name)
def test_imports_follow_design(pkg_dir: Path):
    src = pkg_dir / "src"
    (import_name,) = [p.name for p in src.iterdir() if p.is_dir() and not p.name.endswith(".egg-info")]
    used: dict[str, list[str]] = {}
    for py in src.rglob("*.py"):
        for mod in imports_of(py):
            if mod in sys.stdlib_module_names or mod == import_name or mod == "__future__":
                continue
            used.setdefault(mod, []).append(str(py.relative_to(ROOT)))
    bad = {m: f for m, f in used.items() if m not in ALLOWED[import_name] or m in FORBIDDEN.get(import_name, ())}
    assert not bad, f"{import_name} imports outside DESIGN.md's graph: {bad}"
    deps = declared(pkg_dir)
    undeclared = {m: f for m, f in used.items() if m not in OPTIONAL and DIST_OF.get(m, m).replace("_", "-") not in deps}
    assert not undeclared, f"{pkg_dir.name} imports packages its pyproject.toml does not declare: {undeclared}"


def test_rl_algos_declares_torch_only():
    assert declared(ROOT / "packages" / "rl-algos") == {"torch"}
