"""rl-algos installs alone: a fresh virtual environment gets rl-algos, torch and torch's
own dependencies, nothing else; and ``import rl_algos`` loads no sibling or heavy library.

Uses uv (the workspace's tool) with its cache, so no download happens when the
workspace is synced. torch is constrained to the version this environment runs
(the lock's), so the new venv does not fetch a different torch.
"""

from __future__ import annotations

import json
import shutil
import tomllib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys, importlib.metadata as md, re
import rl_algos
heavy = sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'deepspeed', 'ray', 'vllm', 'rl_rollout',
                                                        'rl_core', 'rl_placement', 'rl_cli', 'peft', 'datasets'})
def closure(name, seen, extras=()):
    key = name.lower().replace('_', '-')
    for e in extras:  # requirements like cuda-toolkit[cufft,curand]
        seen.discard((key, e))
    if key in seen and not extras:
        return
    seen.add(key)
    for req in md.requires(name) or []:
        m = re.search(r'extra\s*==\s*["\']([^"\']+)', req)
        if m and m.group(1) not in extras:
            continue
        dep = re.split(r'[<>=!~\[ ;(]', req, maxsplit=1)[0]
        br = re.match(r'[^\[;]*\[([^\]]*)\]', req)
        sub = tuple(x.strip() for x in br.group(1).split(',')) if br else ()
        try:
            md.version(dep)
        except md.PackageNotFoundError:
            continue  # a marker excluded it on this platform
        closure(dep, seen, sub)
torch_deps = set()
closure('torch', torch_deps)
installed = {d.metadata['Name'].lower().replace('_', '-') for d in md.distributions()}
print(json.dumps({'heavy': heavy, 'installed': sorted(installed), 'torch_closure': sorted(x for x in torch_deps if isinstance(x, str)),
                  'version': rl_algos.__version__}))
"""


@pytest.mark.timeout(600)
def test_rl_algos_installs_with_torch_only(tmp_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH; .ci/run installs it (pip install uv)")
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    py = venv / "bin" / "python"
    constraint = tmp_path / "constraints.txt"
    constraint.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(py), "-c", str(constraint), str(ROOT / "packages" / "rl-algos")],
        check=True,
    )
    out = subprocess.run([str(py), "-c", PROBE], check=True, capture_output=True, text=True).stdout
    info = json.loads(out.strip().splitlines()[-1])
    assert info["heavy"] == [], f"import rl_algos loaded {info['heavy']}"
    extra = set(info["installed"]) - set(info["torch_closure"]) - {"rl-algos"}
    assert not extra, f"installing rl-algos brought more than torch and its dependencies: {sorted(extra)}"
    assert "torch" in info["installed"] and "rl-algos" in info["installed"]
    want = tomllib.loads((ROOT / "packages" / "rl-algos" / "pyproject.toml").read_text())["project"]["version"]
    assert info["version"] == want
