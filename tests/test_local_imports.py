"""Imports sit at the top of a module unless they are heavy or optional, and then the line says so (issue 35
item 7). A function-local import is how a module reaches something lazily: a heavy library that a light entry
point (``rl --help``, ``import rl_rollout``) must not pay for, an optional extra that may be absent, or a module
that would close an import circle. Any other reason is a hidden dependency a reader cannot see at the top.

Allowed inside a function: an import of a third-party library in ``HEAVY_OR_OPTIONAL`` (named by its top-level
package), or any import whose line carries a ``# lazy: <why>`` comment (or that sits in a run of imports right
under a ``# lazy: <why>`` comment line).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").glob("*/src"))

# Heavy to import (seconds of CPU, or CUDA/Ray state) or optional extras a user may not have installed.
HEAVY_OR_OPTIONAL = {
    "torch",
    "transformers",
    "deepspeed",
    "vllm",
    "ray",
    "peft",
    "liger_kernel",
    "flash_attn",
    "bitsandbytes",
    "PIL",
    "tensorboard",
    "torch_tensorboard",
    "tensorboardX",
    "wandb",
    "mlflow",
    "datasets",
    "accelerate",
    "safetensors",
    "numpy",
    "triton",
    "math_verify",
    "sympy",
    "fastapi",
    "uvicorn",
    "httpx",
    "trl",
    "openai",
    "huggingface_hub",
    "tokenizers",
    "pynvml",
    "torchvision",
}


def _lazy_lines(source: str) -> set[int]:
    """Line numbers (1-based) covered by a ``# lazy:`` comment: its own line, or a run of import lines under it."""
    lines = source.splitlines()
    out: set[int] = set()
    for i, line in enumerate(lines):
        if "# lazy:" not in line:
            continue
        out.add(i + 1)
        if line.strip().startswith("# lazy:"):
            j = i + 1
            while (
                j < len(lines)
                and lines[j].strip().startswith(("import ", "from ", ")"))
                or (j < len(lines) and lines[j].startswith((" ", "\t")) and lines[j].strip().endswith((",", "(")))
            ):
                out.add(j + 1)
                j += 1
    return out


def _offenders(path: Path) -> list[str]:
    source = path.read_text()
    tree = ast.parse(source)
    lazy = _lazy_lines(source)
    bad: list[str] = []

    def check(node: ast.AST) -> None:
        for child in ast.walk(node):
            if isinstance(child, ast.Import):
                roots = {a.name.split(".")[0] for a in child.names}
            elif isinstance(child, ast.ImportFrom):
                roots = {"." if child.level else (child.module or "").split(".")[0]}
            else:
                continue
            if roots <= HEAVY_OR_OPTIONAL:
                continue
            if child.lineno in lazy or (child.end_lineno or child.lineno) in lazy:
                continue
            bad.append(f"{path.relative_to(ROOT)}:{child.lineno}: {ast.get_source_segment(source, child)}")

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body:
                check(stmt)
    return sorted(set(bad))


@pytest.mark.parametrize("src", PACKAGES, ids=lambda p: p.parent.name)
def test_function_local_imports_are_heavy_optional_or_say_why(src: Path) -> None:
    bad = [line for path in sorted(src.rglob("*.py")) for line in _offenders(path)]
    assert not bad, (
        f"{len(bad)} function-local imports neither of a heavy/optional library nor marked '# lazy: <why>': move "
        "each to the top of its module, or say on its line why it must wait:\n" + "\n".join(bad)
    )
