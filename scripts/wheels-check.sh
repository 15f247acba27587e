#!/usr/bin/env bash
# Install as a user will: build every package's wheel and sdist (uv build), check their metadata against the
# pyprojects (scripts/check_dists.py), install the wheels alone into a fresh venv outside the workspace (the
# third-party versions pinned to uv.lock's, so the uv cache serves them), and run `import rl_algos` and
# `rl demo --iterations 3` from there. Run by .ci/run; by hand: bash scripts/wheels-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d "${TMPDIR:-/tmp}/rl-wheels.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

uv build --all-packages -o "$tmp/dist" -q
ls "$tmp/dist"
uv run --locked python scripts/check_dists.py "$tmp/dist"

uv export --locked --all-packages --no-dev --no-hashes --no-emit-workspace --format requirements.txt \
    -o "$tmp/constraints.txt" -q
uv venv -q "$tmp/venv" --python "$(uv run --locked python -c 'import sys; print(sys.executable)')"
uv pip install -q --python "$tmp/venv/bin/python" "$tmp"/dist/*.whl -c "$tmp/constraints.txt"

cd "$tmp"  # outside the clone: nothing of the workspace's sources is importable from here
env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u PYTHONPATH "$tmp/venv/bin/python" - <<'PY'
import pathlib, rl_algos, torch
here = pathlib.Path(rl_algos.__file__)
assert "site-packages" in here.parts, f"rl_algos came from {here}, not the installed wheel"
from rl_algos import policy_loss  # noqa: F401  (the losses alone, as `pip install rl-algos` users take them)
print(f"import rl_algos {rl_algos.__version__} from {here.parent}")
PY
env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u PYTHONPATH "$tmp/venv/bin/rl" demo \
    --workdir "$tmp/demo" --iterations 3 2>&1 | grep '^\[rl demo\]'
test -s "$tmp/demo/run/metrics.jsonl" || { echo "FAIL: rl demo from the wheels wrote no metrics"; exit 1; }
echo "wheels: built, checked, installed alone, rl demo ran from them"
