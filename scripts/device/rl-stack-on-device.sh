#!/bin/bash
# rl-stack-on-device.sh - put Ray 2.60.0 and DeepSpeed 0.19.8 (plus this repo's packages) on the lent GPU machine,
# whose image has torch and transformers but no ray or deepspeed and no network (shared/ENVIRONMENT.md).
#
# 1. HERE, in the repo root (needs PyPI; no GPU-machine time):
#        bash scripts/device/rl-stack-on-device.sh prepare
#    Downloads the cp312 wheels and DeepSpeed's sdist into the git-ignored folders .vcarry1 and .vcarry2
#    (Ray's 76 MiB wheel is split in two: one command carries at most 64 MiB with the repo).
# 2. ON THE GPU MACHINE, two `run` calls back to back (it goes back 30 s after a command ends):
#        carry [".vcarry1"]  command: mkdir -p /tmp/rlparts && cp .vcarry1/* /tmp/rlparts/
#        carry [".vcarry2"]  command: source .vcarry2/rl-stack-on-device.sh install && <your command>
#    If the second reply says "warm": false the first part is gone: send both again.
#    `install` also sets PYTHONPATH to /tmp/site and the packages' src folders, so `python3 -m rl_cli.main ...`,
#    `python3 benchmarks/...` and `python3 -m pytest packages/...` run from the repo root.
#    Later calls on the same warm machine: `source /tmp/rlparts/rl-stack-on-device.sh env`.
# 3. HERE, afterwards: rm -rf .vcarry*
#
# Measured there (2026-12-04, nvidia-h200, Python 3.12, torch 2.11.0+cu130): see docs/performance.md.
set -u
RAY_WHL=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
WHEELS="ray==2.60.0 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5
annotated-types==0.8.0 typing-extensions==4.16.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
referencing==0.37.0 rpds-py==2026.9.1"
PLATS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
--platform manylinux2014_x86_64 --platform manylinux1_x86_64"

_prepare() {
  set -e
  rm -rf .vcarry1 .vcarry2 .vcarry-dl && mkdir -p .vcarry-dl .vcarry1 .vcarry2
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATS \
    -d .vcarry-dl $WHEELS
  python3 -m pip download -q --no-deps --no-binary=:all: -d .vcarry-dl deepspeed==0.19.8
  split -n 2 -d -a 1 ".vcarry-dl/$RAY_WHL" .vcarry-dl/ray.whl.part- && rm ".vcarry-dl/$RAY_WHL"
  mv .vcarry-dl/ray.whl.part-0 .vcarry1/
  mv .vcarry-dl/ray.whl.part-1 .vcarry-dl/*.whl .vcarry-dl/deepspeed-*.tar.gz .vcarry2/
  cp "$0" .vcarry2/rl-stack-on-device.sh
  rm -rf .vcarry-dl
  du -sh .vcarry1 .vcarry2
}

_env() {
  local root; root=$(pwd)
  export PYTHONPATH=/tmp/site:$root/packages/rl-algos/src:$root/packages/rl-rollout/src:$root/packages/rl-placement/src:$root/packages/rl-core/src:$root/packages/rl-cli/src
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 DO_NOT_TRACK=1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device README's rule
  export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
}

_install() {
  local here; here=$(dirname "${BASH_SOURCE[0]}")
  [ -f /tmp/rlparts/ray.whl.part-0 ] || { echo "no /tmp/rlparts/ray.whl.part-0: send the .vcarry1 command first"; return 1; }
  cp "$here"/* /tmp/rlparts/
  cat /tmp/rlparts/ray.whl.part-0 /tmp/rlparts/ray.whl.part-1 > "/tmp/rlparts/$RAY_WHL"
  local t0=$SECONDS
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/rlparts/*.whl || return 1
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --target /tmp/site /tmp/rlparts/deepspeed-*.tar.gz || return 1
  _env
  echo "installed ray + deepspeed in $((SECONDS - t0)) s"
  python3 -c "import ray, deepspeed, torch; print('ray', ray.__version__, 'deepspeed', deepspeed.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
}

case "${1:-}" in
  prepare) _prepare ;;
  install) _install ;;
  env) _env ;;
  *) echo "usage: $0 prepare | source $0 install | source $0 env"; return 2 2>/dev/null || exit 2 ;;
esac
