#!/bin/bash
# openrlhf-on-device.sh - carry OpenRLHF 0.11.2 to the lent GPU machine for benchmarks/grpo_vs_openrlhf.py (OpenRLHF's
# train_ppo_ray, hybrid engine: actor + vLLM colocated on the one GPU, GRPO, against `rl ppo --rollout_engine vllm`),
# on top of the vLLM carry of vllm-loop-on-device.sh (vLLM 0.26.0, DeepSpeed 0.19.8, Ray 2.60.0).
#
# DEVICE CALLS (6, back to back, ~20 min of device time with the machine's start; it goes back 30 s after a call
# ends; a reply with "warm": false -> start again at 1):
#   HERE first:  DS_BUILD_PY=/work/main/.venv/bin/python bash scripts/device/vllm-loop-on-device.sh prepare
#                bash scripts/device/openrlhf-on-device.sh prepare
#   (N = the vLLM carry's last folder, 3 as of 2026-12-07; vllm-loop's prepare prints it)
#   1: carry [".vcarry1"]  command: mkdir -p /tmp/vparts && cp .vcarry1/* /tmp/vparts/ && ls /tmp/vparts
#   2: carry [".vcarry2"]  command: mkdir -p /tmp/vparts && cp .vcarry2/* /tmp/vparts/ && ls /tmp/vparts
#   3: carry [".vcarry-ray", ".vcarry-orlhf"]  (45.4 + 1.2 MiB + the repo's 4 MiB)  command:
#        mkdir -p /tmp/vparts-ray /tmp/vparts-orlhf && cp .vcarry-ray/* /tmp/vparts-ray/ && cp .vcarry-orlhf/* /tmp/vparts-orlhf/
#   4: carry [".vcarry3"]  command (installs everything, checks OpenRLHF imports and parses its command line, ~2 min):
#        source .vcarry3/vllm-loop-on-device.sh install && source /tmp/vparts-orlhf/openrlhf-on-device.sh install &&
#        python3 benchmarks/grpo_vs_openrlhf.py --dry_run --openrlhf_pythonpath /tmp/site-orlhf --workdir /tmp/orlhf-work
#      (the dry run also writes the 0.5B random model into --workdir, which calls 5 and 6 reuse)
#   5: no carry, timeout_s 600  command (OpenRLHF's side first: it is the one that may not run):
#        source /tmp/vllm-loop-on-device.sh env && python3 benchmarks/grpo_vs_openrlhf.py --sides openrlhf
#        --openrlhf_pythonpath /tmp/site-orlhf --out /tmp/orlhf.json --workdir /tmp/orlhf-work 2>&1 | tail -150
#   6: no carry  command (ours, then the report of both; --load takes OpenRLHF's records from call 5):
#        source /tmp/vllm-loop-on-device.sh env && python3 benchmarks/grpo_vs_openrlhf.py --sides ours
#        --load /tmp/orlhf.json --out /tmp/both.json --workdir /tmp/orlhf-work 2>&1 | tail -150
#   (`--sides both` runs the two in one call when 600 s are enough: ours ~3 min, OpenRLHF ~5 min with its start.)
#
# What travels (.vcarry-orlhf, 1.2 MB), installed into /tmp/site-orlhf, which only OpenRLHF's process puts on its path
# (--openrlhf_pythonpath), so our side runs with exactly the vLLM carry:
# - openrlhf 0.11.2 (its cp312 wheel; pure Python; its stray top-level `tests` package is removed after install)
# - pylatexenc 2.11 (openrlhf.utils.math_utils imports it at `import openrlhf.utils`), torchdata 0.11.0 (the
#   StatefulDataLoader of openrlhf/utils/deepspeed/deepspeed.py), datasets 5.2.0 + multiprocess 0.70.19 (its prompt
#   loading; dill 0.4.1 comes with the vLLM carry). The image has the rest it imports: peft, accelerate, aiohttp,
#   sympy, tensorboard, torchmetrics, pandas, pyarrow, einops, psutil, nvidia-ml-py (KINDS.md's list).
# - flash_attn: a stub package written by install. openrlhf/models/ring_attn_utils.py imports
#   flash_attn.bert_padding and flash_attn.utils.distributed at the top, and models/actor.py imports that module, so
#   `import openrlhf.cli.train_ppo_ray` fails without flash-attn, which has no wheel (source only, a long nvcc build).
#   Those functions run only with --ds.packing_samples or ring attention; the benchmark uses neither (packing would force
#   flash_attention_2: train_ppo_ray.py resets --ds.attn_implementation to it) and passes --ds.attn_implementation sdpa.
#   The stub's functions raise, naming this. It has no dist-info, so transformers' is_flash_attn_2_available() stays
#   False; vLLM's CUDA attention uses its own vllm.vllm_flash_attn.
# Version gaps (OpenRLHF 0.11.2 pins vllm==0.29.0, ray[default]==2.55.0, deepspeed==0.19.6, transformers==5.15.0,
# flash-attn==2.8.3): vLLM 0.29.0 pins torch==2.13.0 and the device has torch 2.11.0, so the vLLM is 0.26.0 (the newest
# pinning torch 2.11.0), whose API has everything OpenRLHF calls (AsyncLLMEngine = v1 AsyncLLM with sleep / wake_up(tags)
# / pause_generation(mode=) / collective_rpc / reset_prefix_cache, worker_extension_cls, logprobs_mode,
# vllm.utils.random_uuid, vllm.inputs.TokensPrompt, StatelessProcessGroup, PyNcclCommunicator): checked against the
# 0.26.0 wheel's sources. Ray 2.60.0, DeepSpeed 0.19.8 and transformers 5.17 are newer patch/minor releases of the
# pinned ones; nothing found that they break, nothing run yet on a GPU.
WHEELS="openrlhf-0.11.2-cp312-cp312-manylinux1_x86_64.whl pylatexenc-2.11-py2.py3-none-any.whl
torchdata-0.11.0-py3-none-any.whl datasets-5.2.0-py3-none-any.whl multiprocess-0.70.19-py312-none-any.whl"
SHA256="94486a29b7f0c2e9d9f7dec266af23ed5c51c70046258d1c38e4721c5d08b05b  openrlhf-0.11.2-cp312-cp312-manylinux1_x86_64.whl
e78e7391d6c104f1ed150e21cfaa58016cdb50aa54406a2eecb793649ffdfdd0  pylatexenc-2.11-py2.py3-none-any.whl
52b940fbbe0e00fb21cabddf528449d1bec5bfb0d0823b7487b15f951658ee33  torchdata-0.11.0-py3-none-any.whl
4be9e2882caaf5db13eadc39e93f3da2a995187b99acebac1595bf6c58dfa927  datasets-5.2.0-py3-none-any.whl
3a56c0e85dd5025161bac5ce138dcac1e49174c7d8e74596537e729fd5c53c28  multiprocess-0.70.19-py312-none-any.whl"
ORLHF_SITE=${ORLHF_SITE:-/tmp/site-orlhf}
ORLHF_PY=${ORLHF_PY:-python3}

_or_prepare() {
  set -euo pipefail
  local root self; root=$(git rev-parse --show-toplevel); self=$(readlink -f "${BASH_SOURCE[0]}"); cd "$root"
  rm -rf .vcarry-orlhf && mkdir -p .vcarry-orlhf
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .vcarry-orlhf openrlhf==0.11.2 pylatexenc==2.11 \
    torchdata==0.11.0 datasets==5.2.0 multiprocess==0.70.19 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  (cd .vcarry-orlhf && echo "$SHA256" | sha256sum -c --quiet -)
  cp "$self" .vcarry-orlhf/openrlhf-on-device.sh
  git check-ignore -q .vcarry-orlhf || echo "WARNING: .vcarry-orlhf is not git-ignored (it would travel in every call)"
  local tree mine ray=0
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
  mine=$(du -sb .vcarry-orlhf | cut -f1)
  [ -d .vcarry-ray ] && ray=$(du -sb .vcarry-ray | cut -f1) ||
    echo "WARNING: no .vcarry-ray: run scripts/device/vllm-loop-on-device.sh prepare (call 3 carries both folders)"
  echo ".vcarry-orlhf: $mine bytes: $(ls .vcarry-orlhf | paste -sd' ')"
  echo "call 3 carries $(( (tree + mine + ray) / 1048576 )) MiB with the repo (limit 64)"
  [ $(( tree + mine + ray )) -le $(( 62 * 1048576 )) ] || { echo ".vcarry-ray + .vcarry-orlhf + the repo exceed 62 MiB"; exit 1; }
}

_or_shim() {  # the flash_attn stub (see the header)
  local d="$ORLHF_SITE/flash_attn"
  mkdir -p "$d/utils"
  cat > "$d/__init__.py" <<'PY'
"""Stub written by scripts/device/openrlhf-on-device.sh: OpenRLHF 0.11.2 imports flash_attn.bert_padding and
flash_attn.utils.distributed at the top of openrlhf/models/ring_attn_utils.py; flash-attn has no wheel for this
machine. Their functions are used only with --ds.packing_samples or ring attention (--ds.ring_attn_size > 1)."""
__version__ = "0+openrlhf-stub"


def _refuse(name):
    def f(*args, **kwargs):
        raise RuntimeError(f"flash_attn.{name}: this is the stub of scripts/device/openrlhf-on-device.sh (flash-attn "
                           "has no wheel here); OpenRLHF calls it only with --ds.packing_samples or --ds.ring_attn_size "
                           "> 1: drop those flags and pass --ds.attn_implementation sdpa")
    return f
PY
  cat > "$d/bert_padding.py" <<'PY'
from flash_attn import _refuse

index_first_axis = _refuse("bert_padding.index_first_axis")
pad_input = _refuse("bert_padding.pad_input")
unpad_input = _refuse("bert_padding.unpad_input")
rearrange = _refuse("bert_padding.rearrange")
PY
  echo "" > "$d/utils/__init__.py"
  cat > "$d/utils/distributed.py" <<'PY'
from flash_attn import _refuse

all_gather = _refuse("utils.distributed.all_gather")
PY
}

_or_install() {  # on the device, after the vLLM carry's install (it sets PYTHONPATH and installs Ray)
  local here w files=() t0=$SECONDS
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  (cd "$here" && echo "$SHA256" | sha256sum -c --quiet -) ||
    { echo "openrlhf-on-device: wheels missing or corrupt in $here: send call 3 again"; return 1; }
  for w in $WHEELS; do files+=("$here/$w"); done
  "$ORLHF_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$ORLHF_SITE" \
    "${files[@]}" 2>&1 | grep -v -e "already exists" -e "Running pip as the 'root' user" | tail -3
  rm -rf "$ORLHF_SITE/tests" "$ORLHF_SITE/bin"  # openrlhf's wheel ships its own top-level `tests` package
  _or_shim
  cp "${BASH_SOURCE[0]}" /tmp/openrlhf-on-device.sh 2>/dev/null || true
  PYTHONPATH="$ORLHF_SITE${PYTHONPATH:+:$PYTHONPATH}" "$ORLHF_PY" - <<'PY' || return 1
import importlib.metadata as md
import time

t = time.time()
import openrlhf.cli.train_ppo_ray  # noqa: F401  - what `python -m openrlhf.cli.train_ppo_ray` imports

def v(p):
    try:
        return md.version(p)
    except md.PackageNotFoundError:
        return "MISSING"

print(f"openrlhf.cli.train_ppo_ray imports ({time.time() - t:.0f} s): " + ", ".join(
    f"{p} {v(p)}" for p in ("openrlhf", "vllm", "ray", "deepspeed", "transformers", "torch", "peft", "datasets",
                            "torchdata", "pylatexenc", "accelerate", "aiohttp")))
PY
  echo "openrlhf-on-device: installed in $ORLHF_SITE in $((SECONDS - t0)) s (pass --openrlhf_pythonpath $ORLHF_SITE)"
}

case "${1:-}" in
  prepare) ( _or_prepare ) ;;
  install) _or_install ;;
  *) echo "usage: bash scripts/device/openrlhf-on-device.sh prepare (here) |" \
          "source /tmp/vparts-orlhf/openrlhf-on-device.sh install (device, after the vLLM carry's install)"
     return 2 2>/dev/null || exit 2 ;;
esac
