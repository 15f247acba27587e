#!/bin/bash
# train-stack-on-device.sh - the training half of the vLLM carry in ONE device call: DeepSpeed 0.19.8 (the wheel built
# by vllm-loop-on-device.sh prepare), its runtime deps, liger-kernel 0.8.5 and pytest-timeout; about 6 MB. For the
# benchmarks and tests that train but run no vLLM (sft_throughput.py, fused_lm_head.py, rl_packing.py,
# zero_one_rank.py, the rl-algos/rl-core GPU tests) when device minutes are short: no 3-call vLLM carry.
#
# 1. HERE, after `bash scripts/device/vllm-loop-on-device.sh prepare` (its scratch holds the wheels):
#        bash scripts/device/train-stack-on-device.sh prepare          # writes the git-ignored .vcarry7
# 2. THERE, one call carrying [".vcarry7"]:
#        source .vcarry7/train-stack-on-device.sh install && python3 benchmarks/sft_throughput.py --device cuda ...
#    install: checks the sha256 of every wheel, pip-installs them into /tmp/site (--no-deps --no-index) and sets
#    PYTHONPATH and the environment with vllm-loop-on-device.sh's `env`.
WHEELS="deepspeed-0.19.8 hjson-3.1.0 py_cpuinfo-9.0.0 einops-0.8.2 psutil-7.2.2 nvidia_ml_py-13.615.71
pydantic-2.14.4 pydantic_core-2.50.5 typing_inspection-0.4.5 annotated_types-0.8.0 typing_extensions-4.16.0
liger_kernel-0.8.5 pytest_timeout-2.4.0"

_ts_prepare() {
  set -euo pipefail
  local root self src w f; root=$(git rev-parse --show-toplevel); self=$(readlink -f "${BASH_SOURCE[0]}"); cd "$root"
  src=${VLOOP_SCRATCH:-/tmp/vloop-prepare}/wheels
  rm -rf .vcarry7 && mkdir -p .vcarry7
  for w in $WHEELS; do
    f=$(ls "$src/$w"-*.whl 2>/dev/null | head -1)
    [ -n "$f" ] || { echo "no $w wheel in $src: run scripts/device/vllm-loop-on-device.sh prepare first"; exit 1; }
    cp "$f" .vcarry7/
  done
  cp "$self" .vcarry7/train-stack-on-device.sh
  (cd .vcarry7 && sha256sum ./*.whl > SHA256SUMS)
  git check-ignore -q .vcarry7 || echo "WARNING: .vcarry7 is not git-ignored (it would travel in every call)"
  echo ".vcarry7: $(du -sb .vcarry7 | cut -f1) bytes, $(ls .vcarry7/*.whl | wc -l) wheels"
}

_ts_install() {  # from the repo root, in the call that carries .vcarry7
  local here t0=$SECONDS; here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  (cd "$here" && sha256sum -c --quiet SHA256SUMS) || { echo "train-stack: wheels missing or corrupt in $here"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$here"/*.whl 2>&1 | grep -v "Running pip as the 'root' user" | tail -3
  source scripts/device/vllm-loop-on-device.sh env  # the same PYTHONPATH and environment (it travels with the repo)
  python3 -c "import deepspeed, liger_kernel, torch; print('train stack in', $((SECONDS - t0)), 's: deepspeed', deepspeed.__version__, 'torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')"
}

case "${1:-}" in
  prepare) ( _ts_prepare ) ;;
  install) _ts_install ;;
  *) echo "usage: bash $0 prepare (here) | source .vcarry7/train-stack-on-device.sh install (device)"
     return 2 2>/dev/null || exit 2 ;;
esac
