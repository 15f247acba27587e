#!/bin/bash
# trl-on-device.sh - carry TRL 1.16.0 to the lent GPU machine for benchmarks/grpo_vs_trl.py (TRL's GRPOTrainer with
# its colocated vLLM against `rl ppo --rollout_engine vllm`), beside the vLLM carry of vllm-loop-on-device.sh.
#
# What travels: trl 1.16.0, datasets 5.2.0 and multiprocess 0.70.19 (cp312), 1.7 MB, the workspace's locked versions.
# Everything else TRL's import path and its vLLM colocate path load is on the GPU image (accelerate, pandas, pyarrow,
# fsspec, xxhash, rich, huggingface_hub, jinja2, pyyaml, psutil, requests, tqdm; KINDS.md's package list) or in the
# vLLM carry (dill 0.4.1; vLLM 0.26.0, inside TRL 1.16's supported 0.22-0.31). Checked 2026-12-04 on CPU in a
# Python 3.12 venv holding only torch, transformers 5.17.0, accelerate 1.15.0, huggingface_hub 1.33.0, pandas 2.3.3,
# pyarrow 21.0.0 (below datasets 5.2.0's declared 24, and it works), the image's small packages and these wheels:
# `from trl import GRPOTrainer` and `datasets.Dataset.from_list` run. Of vLLM, TRL 1.16 imports (vLLM < 0.28)
# vllm.distributed.weight_transfer.nccl_engine's NCCLTrainerSendWeightsArgs / NCCLWeightTransferEngine and
# vllm.utils.network_utils.get_ip: all in 0.26.0's wheel.
#
# 1. HERE, in the repo root (needs PyPI):  bash scripts/device/trl-on-device.sh prepare
#    writes the git-ignored folder .vcarry6 (the 3 wheels + this script as install.sh).
# 2. ON THE GPU MACHINE, one call carrying [".vcarry6"]: mkdir -p /tmp/vparts6 && cp .vcarry6/* /tmp/vparts6/
#    (.vcarry6 fits no call that carries a 60 MiB vLLM part), then in the call that installs vLLM, after it:
#        source .vcarry3/vllm-loop-on-device.sh install && bash /tmp/vparts6/install.sh && python3 benchmarks/...
#    install: checks the wheels' sha256, pip-installs them into /tmp/site (--no-deps, no --upgrade: nothing the vLLM
#    carry put there is replaced; a second run is a no-op), checks the versions TRL and datasets ask for and imports
#    GRPOTrainer (about 20 s). PYTHONPATH comes from the vLLM carry's install/env.
WHEELS="trl-1.16.0-py3-none-any.whl datasets-5.2.0-py3-none-any.whl multiprocess-0.70.19-py312-none-any.whl"
SHA256="c4726e139dd40e1a41661511c639c8a68416782b2e3e8c0befebd77bb7ba0396  trl-1.16.0-py3-none-any.whl
4be9e2882caaf5db13eadc39e93f3da2a995187b99acebac1595bf6c58dfa927  datasets-5.2.0-py3-none-any.whl
3a56c0e85dd5025161bac5ce138dcac1e49174c7d8e74596537e729fd5c53c28  multiprocess-0.70.19-py312-none-any.whl"

_trl_prepare() {
  set -euo pipefail
  local root self; root=$(git rev-parse --show-toplevel); self=$(readlink -f "${BASH_SOURCE[0]}"); cd "$root"
  rm -rf .vcarry6 && mkdir -p .vcarry6
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .vcarry6 trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  (cd .vcarry6 && echo "$SHA256" | sha256sum -c --quiet -)
  cp "$self" .vcarry6/install.sh
  git check-ignore -q .vcarry6 || echo "WARNING: .vcarry6 is not git-ignored (it would travel in every call)"
  echo ".vcarry6: $(du -sb .vcarry6 | cut -f1) bytes: $(ls .vcarry6 | paste -sd' ')"
}

_trl_install() {
  local here site=${VLOOP_SITE:-/tmp/site} w files=()
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  (cd "$here" && echo "$SHA256" | sha256sum -c --quiet -) ||
    { echo "trl-on-device: wheels missing or corrupt in $here"; return 1; }
  python3 -c "import sys; sys.path.insert(0, '$site'); import vllm" 2>/dev/null ||
    echo "trl-on-device: vllm does not import from $site: install the vLLM carry first (TRL's vLLM mode needs it)"
  for w in $WHEELS; do files+=("$here/$w"); done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${files[@]}" 2>&1 |
    grep -v -e "already exists" -e "Running pip as the 'root' user" | tail -3
  python3 - "$site" <<'PY'
import importlib.metadata as md
import sys
import time

sys.path.insert(0, sys.argv[1])
from packaging.specifiers import SpecifierSet
from packaging.version import Version

# TRL 1.16.0's and datasets 5.2.0's Requires-Dist (pyarrow: TRL's floor; datasets declares 24, 21 was checked)
need = {"trl": "==1.16.0", "datasets": "==5.2.0", "multiprocess": "==0.70.19", "dill": ">=0.3.0,<0.4.2",
        "accelerate": ">=1.10.1", "transformers": ">=4.56.2", "pandas": ">=2.1.1", "pyarrow": ">=21.0.0",
        "huggingface_hub": ">=1.31.0,<3.0", "fsspec": ">=2023.1.0", "xxhash": "", "jinja2": "", "pyyaml": ">=6.0.1",
        "psutil": ">=5.9.4"}


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


bad = [f"{n} {version(n) or 'MISSING'} (wants {s or 'any'})" for n, s in need.items()
       if version(n) is None or Version(version(n)) not in SpecifierSet(s)]
if bad:
    sys.exit("trl-on-device: TRL's stack is incomplete here: " + "; ".join(bad))
vllm = version("vllm")
if vllm is None or Version(Version(vllm).base_version) not in SpecifierSet(">=0.22,<=0.31"):
    print(f"trl-on-device: vllm {vllm or 'MISSING'}: TRL 1.16's vLLM modes support 0.22-0.31")
t = time.time()
import trl
from trl import GRPOConfig, GRPOTrainer  # noqa: F401

print(f"TRL {trl.__version__} imports ({time.time() - t:.0f} s): datasets {version('datasets')}, accelerate "
      f"{version('accelerate')}, transformers {version('transformers')}, pyarrow {version('pyarrow')}, pandas "
      f"{version('pandas')}, vllm {vllm}")
PY
}

case "${1:-install}" in
  prepare) ( _trl_prepare ) ;;
  install) _trl_install ;;
  *) echo "usage: bash scripts/device/trl-on-device.sh prepare (here) | bash /tmp/vparts6/install.sh (device)"
     exit 2 ;;
esac
