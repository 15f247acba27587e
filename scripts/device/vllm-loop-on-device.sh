#!/bin/bash
# vllm-loop-on-device.sh - run this repo's one-process RL loop with vLLM as the engine on the lent GPU machine
# (`python3 -m rl_cli.main ppo --rollout_engine vllm ...`, `python3 benchmarks/rl_phases.py --rollout_engine vllm`,
# the GPU tests). That machine (one H200, Python 3.12, torch 2.11.0+cu130, transformers; no network, no vllm or
# deepspeed) gets, carried from here: vLLM 0.26.0 (the newest pinning torch==2.11.0) pruned for Hopper + Python
# 3.12, its 28 small dependency wheels, DeepSpeed 0.19.8 as a pure-Python wheel built here from its sdist
# (DS_BUILD_OPS=0 DS_ACCELERATOR=cuda: no compile there), DeepSpeed's runtime deps, what `--run_dir` needs
# (rl-core's MetricsLogger writes TensorBoard events and draws curves.png with matplotlib), pytest-timeout and
# liger-kernel 0.8.5 (--use_liger_kernel and the benchmarks' liger sides) torchvision 0.26.0 and mistral_common (vLLM with images).
#
# 1. HERE, in the repo root (needs PyPI and .venv with torch, for DeepSpeed's setup.py; no GPU-machine time):
#        bash scripts/device/vllm-loop-on-device.sh prepare
#    Writes the git-ignored folders .vcarry1 .. .vcarryN (each <= 62 MiB minus what the repo sends anyway) and
#    prints the N commands. Scratch (downloads, the 3-minute xz of vLLM, cached) in $VLOOP_SCRATCH
#    (default /tmp/vloop-prepare). VLLM_WHL=/path/to/the PyPI wheel reuses a download; DS_BUILD_PY=python with
#    torch builds DeepSpeed's wheel (default .venv/bin/python).
# 2. ON THE GPU MACHINE: the N commands BACK TO BACK (it goes back 30 s after a command ends). Calls 1..N-1:
#        carry [".vcarryK"]  command: mkdir -p /tmp/vparts && cp .vcarryK/* /tmp/vparts/ && ls /tmp/vparts
#    Call N:
#        carry [".vcarryN"]  command: source .vcarryN/vllm-loop-on-device.sh install && <your command>
#    A folder carried by one call is gone in the next; files under /tmp stay while the machine is warm. If a
#    reply says "warm": false, start again at call 1 (install says which part is missing or corrupt).
#    install: checks every part's sha256, rebuilds the vLLM wheel (xz), checks its sha256, pip-installs all
#    wheels into /tmp/site (--no-deps --no-index), sets PYTHONPATH (/tmp/site + packages/*/src) and the env,
#    and copies this script to /tmp. Later calls on the same warm machine:
#        source /tmp/vllm-loop-on-device.sh env && <your command>
#    `bash /tmp/vllm-loop-on-device.sh check` (after install/env) imports everything once (~30 s).
# 3. HERE, afterwards: rm -rf .vcarry*
#
# What is carried and why (checked 2026-12-04 by running `rl ppo` and benchmarks/rl_phases.py on CPU with only
# the image's packages + these importable):
# - vLLM 0.26.0, 289 -> 149 MiB (deflated) by dropping what Hopper + Python 3.12 never loads: the FA2 extension
#   (vllm_flash_attn/_vllm_fa2_C*.so; its import is guarded, vLLM logs "Using FlashAttention version 3"),
#   the `vllm-rs` binary (only VLLM_RUST_FRONTEND_PATH=auto serving uses it), deep_gemm's _C for other
#   Pythons; RECORD rewritten. It travels as an xz of that wheel with its members stored (362 MiB; the FA3
#   .so shrinks 14x under xz, 4x under deflate): 111 MiB, which makes 3 calls enough with the metrics wheels.
#   Engines that fall back to FA2 (ALiBi models, a forced flash_attn_version=2) would fail here.
# - DeepSpeed: hjson, einops, psutil, pydantic (at `import deepspeed`/initialize); py-cpuinfo (CPU Adam,
#   --adam_offload, JIT-built there with the image's ninja + nvcc); nvidia-ml-py (its cuda accelerator's
#   memory query, optional).
# - rl ppo --run_dir: tensorboard, protobuf, absl-py (torch.utils.tensorboard.SummaryWriter), matplotlib,
#   pillow, fonttools, kiwisolver, pyparsing, cycler, python-dateutil, tzdata, contourpy (curves.png). Without
#   --run_dir neither is imported. Not carried, imported only off this path: peft (--lora_rank), pyarrow
#   (parquet prompt files), datasets (save_to_disk folders), ray (rl ppo-ray), wandb (--use_wandb).
#   yaml (--config) and tqdm come with the image's transformers.

VLLM_VERSION=0.26.0
VLLM_WHEEL_NAME=vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
VLLM_SHA256=adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de  # PyPI's, before pruning
DS_VERSION=0.19.8
# vLLM's (the list of /work/shared/gpu/vllm-on-device.sh, measured there): not on the image, needed at
# `import vllm` / engine start, plus declared deps of those and small lazily imported ones.
VLLM_DEPS="pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
cbor2==6.3.0 pyzmq==27.3.0 msgspec==0.23.0 cachetools==8.0.2 pybase64==1.5.1
openai==3.57.0 httpx2==2.16.2 sniffio==1.3.1 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7
fastapi==0.136.3 starlette==1.10.0 xgrammar==0.2.7 apache-tvm-ffi==0.1.10 llguidance==1.7.6
httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 typing-extensions==4.16.0
depyf==0.20.0 astor==0.8.1 dill==0.4.1 setproctitle==1.3.8 blake3==1.0.11"
DS_DEPS="hjson==3.1.0 py-cpuinfo==9.0.0 einops==0.8.2 psutil==7.2.2 nvidia-ml-py==13.615.71"
# the workspace's versions (uv.lock, Python >= 3.11); python-dateutil 4 no longer imports six (3.0 does)
METRICS_DEPS="tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1 matplotlib==3.11.2 pillow==13.0.0
fonttools==4.68.0 kiwisolver==1.5.1 pyparsing==3.3.3 cycler==0.12.1 python-dateutil==4.0.0 tzdata==2026.6
contourpy==1.3.3"
TEST_DEPS="pytest-timeout==2.4.0"
# liger-kernel (--use_liger_kernel, the benchmarks' liger sides): pure Python + Triton kernels; torch brings Triton
KERNEL_DEPS="liger-kernel==0.8.5"
# torchvision (vLLM's multimodal models import transformers' image processors, which import it): PyPI's 0.26.0 is
# built for CUDA 13.0 and pins torch 2.11.0, the image's torch (7.5 MB); tests/test_rollout_vllm_vision_gpu.py
VISION_DEPS="torchvision==0.26.0"
# vLLM's llava module imports its Pixtral tower at the top, which imports mistral_common's protocol classes (seen on
# the device: "No module named 'mistral_common'"); the first five are what that import loads beyond the image, the
# last two what transformers' MistralCommonBackend needs once mistral_common is there (without them that lazy import
# fails inside `from vllm import LLM`, seen on the device) (15 MB).
# They do not fit the last call beside the other wheels: prepare puts them in .vcarry-images, one extra call
# (carry [".vcarry-images"], command: mkdir -p /tmp/vparts-images && cp .vcarry-images/* /tmp/vparts-images/),
# sent before the last; install then adds them. Only vLLM with images needs them.
JSONSCHEMA_DEPS="jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1"
MM_DEPS="mistral_common==1.13.1 $JSONSCHEMA_DEPS pydantic-extra-types==2.11.1 pycountry==26.2.16"
# Ray (rl ppo-ray's hybrid engine with vLLM: benchmarks/rl_ray_gpus.py --rollout_engine vllm): its 76 MiB wheel less
# ray/jars (30.7 MiB of Java workers, never loaded by Python) is 45 MiB, one call of its own: prepare puts it, pruned,
# and what its import needs beyond the image (jsonschema and its three) in .vcarry-ray; carry [".vcarry-ray"],
# command: mkdir -p /tmp/vparts-ray && cp .vcarry-ray/* /tmp/vparts-ray/, sent before the last; install adds them.
RAY_VERSION=2.60.0
RAY_DEPS="$JSONSCHEMA_DEPS"
PLATS="--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# Where things go on the device (overridable only to simulate install elsewhere).
VLOOP_DIR=${VLOOP_DIR:-/tmp/vparts}
VLOOP_SITE=${VLOOP_SITE:-/tmp/site}
VLOOP_PY=${VLOOP_PY:-python3}

# vLLM's members Hopper + Python 3.12 never load (see the header)
VLLM_DROP='^vllm/(vllm_flash_attn/_vllm_fa2_C[^/]*\.so|vllm-rs|third_party/deep_gemm/_C\.cpython-3(?!12-)\d+-[^/]*\.so)$'
RAY_DROP='^ray/jars/'  # Java workers

_vl_prune() {  # SRC DST DROP_REGEX [deflate]: the wheel less DROP's members, stored (or deflated), RECORD rewritten
  python3 - "$1" "$2" "$3" "${4:-stored}" <<'PY'
import re, shutil, sys, zipfile
src_path, dst_path, drop, how = sys.argv[1:5]
DROP = re.compile(drop)
method = zipfile.ZIP_DEFLATED if how == "deflate" else zipfile.ZIP_STORED
src = zipfile.ZipFile(src_path)
infos = src.infolist()
record = next(i for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename))
dropped = {i.filename for i in infos if DROP.match(i.filename)}
lines = src.read(record).decode().splitlines()
kept = [ln for ln in lines if ln and ln.rsplit(",", 2)[0] not in dropped]
assert len(lines) - len(kept) == len(dropped), "RECORD does not list every dropped file"
with zipfile.ZipFile(dst_path, "w", method) as dst:
    for i in infos:
        if i.filename in dropped:
            continue
        zi = zipfile.ZipInfo(i.filename, i.date_time)
        zi.external_attr, zi.compress_type = i.external_attr, method
        if i is record:
            dst.writestr(zi, "\n".join(kept) + "\n")
            continue
        with src.open(i) as f, dst.open(zi, "w") as g:
            shutil.copyfileobj(f, g, 1 << 22)
print(f"dropped {len(dropped)} files ({sum(src.getinfo(n).compress_size for n in dropped) / 2**20:.1f} MiB "
      f"compressed): " + " ".join(sorted(dropped)))
PY
}

_vl_check_ds_wheel() {  # WHEEL: pure Python, version 0.19.8, no torch pin, built for cuda with no prebuilt ops
  python3 - "$1" "$DS_VERSION" <<'PY'
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1]); want = sys.argv[2]
names = z.namelist()
meta = z.read(f"deepspeed-{want}.dist-info/METADATA").decode()
wheel = z.read(f"deepspeed-{want}.dist-info/WHEEL").decode()
info = z.read("deepspeed/git_version_info_installed.py").decode()
version = re.search(r"^Version: (.+)$", meta, re.M).group(1)
reqs = [r for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]
assert version == want, f"version {version} != {want}"
assert "Tag: py3-none-any" in wheel, wheel
assert not [n for n in names if n.endswith(".so")], "compiled ops in the wheel"
assert not [r for r in reqs if re.match(r"torch\b", r) and "==" in r], f"torch pinned: {reqs}"
assert "accelerator_name='cuda'" in info and "True" not in info.split("installed_ops=")[1].split("\n")[0], info
print(f"deepspeed wheel OK: {version}, py3-none-any, no .so, requires {'; '.join(reqs)}")
PY
}

_vl_prepare() {
  set -euo pipefail
  local self root S dl
  self=$(readlink -f "${BASH_SOURCE[0]}")
  root=$(git rev-parse --show-toplevel); cd "$root"
  S=${VLOOP_SCRATCH:-/tmp/vloop-prepare}; mkdir -p "$S"
  local build_py=${DS_BUILD_PY:-$root/.venv/bin/python}
  local quiet='is ignored: it is neither a file nor a directory'
  dl="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATS"

  echo "== vLLM $VLLM_VERSION wheel"
  local full="$S/full-$VLLM_WHEEL_NAME"
  [ -n "${VLLM_WHL:-}" ] && cp "$VLLM_WHL" "$full"
  if ! echo "$VLLM_SHA256  $full" | sha256sum -c --status 2>/dev/null; then
    rm -rf "$S/dl" && mkdir -p "$S/dl"
    $dl -d "$S/dl" "vllm==$VLLM_VERSION" 2> >(grep -v "$quiet" >&2)
    mv "$S/dl/$VLLM_WHEEL_NAME" "$full"
  fi
  echo "$VLLM_SHA256  $full" | sha256sum -c -

  echo "== pruning (stored members) and xz"
  local stored="$S/$VLLM_WHEEL_NAME" xzf="$S/vllm.whl.xz"
  _vl_prune "$full" "$stored" "$VLLM_DROP"
  local stored_sha; stored_sha=$(sha256sum "$stored" | cut -d' ' -f1)
  if [ ! -f "$xzf" ] || [ "$(cat "$xzf.of" 2>/dev/null)" != "$stored_sha" ]; then
    echo "xz -6 of $(( $(stat -c %s "$stored") / 1048576 )) MiB (about 3 minutes on 2 cores)"
    xz -6 -T0 -c "$stored" > "$xzf.tmp" && mv "$xzf.tmp" "$xzf" && echo "$stored_sha" > "$xzf.of"
  fi
  local xz_sha; xz_sha=$(sha256sum "$xzf" | cut -d' ' -f1)

  echo "== small wheels (cp312)"
  rm -rf "$S/wheels" && mkdir -p "$S/wheels"
  local specs="$VLLM_DEPS $DS_DEPS $METRICS_DEPS $TEST_DEPS $KERNEL_DEPS $VISION_DEPS"
  # shellcheck disable=SC2086
  $dl -d "$S/wheels" $specs 2> >(grep -v "$quiet" >&2)
  local nspec; nspec=$(echo $specs | wc -w)
  [ "$(ls "$S/wheels"/*.whl | wc -l)" = "$nspec" ] || { echo "expected $nspec wheels: $(ls "$S/wheels")"; exit 1; }

  echo "== Ray $RAY_VERSION, pruned of $RAY_DROP"
  rm -rf "$S/ray" && mkdir -p "$S/ray/dl" "$S/ray/out"
  # shellcheck disable=SC2086
  $dl -d "$S/ray/dl" "ray==$RAY_VERSION" $RAY_DEPS 2> >(grep -v "$quiet" >&2)
  local raywhl; raywhl=$(cd "$S/ray/dl" && ls ray-*.whl)
  _vl_prune "$S/ray/dl/$raywhl" "$S/ray/out/$raywhl" "$RAY_DROP" deflate
  rm "$S/ray/dl/$raywhl" && mv "$S"/ray/dl/*.whl "$S/ray/out/"

  rm -rf "$S/images" && mkdir -p "$S/images"
  # shellcheck disable=SC2086
  $dl -d "$S/images" $MM_DEPS 2> >(grep -v "$quiet" >&2)

  echo "== DeepSpeed $DS_VERSION wheel from its sdist (DS_BUILD_OPS=0 DS_ACCELERATOR=cuda, $build_py)"
  rm -rf "$S/ds" && mkdir -p "$S/ds/out"
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$S/ds" "deepspeed==$DS_VERSION" 2> >(grep -v "$quiet" >&2)
  if "$build_py" -m pip --version >/dev/null 2>&1; then
    DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$build_py" -m pip wheel -q --no-deps --no-build-isolation \
      -w "$S/ds/out" "$S/ds/deepspeed-$DS_VERSION.tar.gz"
  else
    DS_BUILD_OPS=0 DS_ACCELERATOR=cuda uv build -q --wheel --no-build-isolation --python "$build_py" \
      -o "$S/ds/out" "$S/ds/deepspeed-$DS_VERSION.tar.gz"
  fi
  _vl_check_ds_wheel "$S/ds/out/deepspeed-$DS_VERSION-py3-none-any.whl"
  cp "$S/ds/out/deepspeed-$DS_VERSION-py3-none-any.whl" "$S/wheels/"

  echo "== packing"
  # room per call: 62 MiB minus what the repo sends anyway (tracked + untracked-not-ignored files, shared/)
  local tree room
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
  [ -d shared ] && tree=$(( tree + $(du -sb shared | cut -f1) ))
  room=$(( 62*1048576 - tree ))
  local small; small=$(( $(cat "$S"/wheels/*.whl "$self" | wc -c) + 65536 ))  # + manifest, SHA256SUMS
  [ $small -lt $room ] || { echo "the small wheels ($small bytes) do not fit one call next to the repo"; exit 1; }
  # N = the fewest calls; the xz is cut so that every folder carries about the same (the small wheels and this
  # script ride in the last one, with the xz's tail when it fits), leaving each call the most headroom.
  local total n chunk k=0 p
  total=$(( $(stat -c %s "$xzf") + small )); n=$(( (total + room - 1) / room )); chunk=$(( (total + n - 1) / n ))
  rm -rf .vcarry* "$S/parts" && mkdir -p "$S/parts"
  split -b $chunk -d -a 2 "$xzf" "$S/parts/vllm.whl.xz.part-"
  for p in "$S"/parts/vllm.whl.xz.part-*; do k=$((k+1)); mkdir -p .vcarry$k; mv "$p" .vcarry$k/; done
  local last=.vcarry$n; mkdir -p $last
  cp "$S"/wheels/*.whl "$last/"
  cp "$self" "$last/vllm-loop-on-device.sh"
  local names wheels
  names=$(ls .vcarry*/vllm.whl.xz.part-* | xargs -n1 basename | sort | paste -sd' ')
  wheels=$(ls "$last"/*.whl | xargs -n1 basename | paste -sd' ')
  {
    echo "# written by prepare $(date -u +%FT%TZ)"
    echo "VLOOP_PARTS=\"$names\""
    echo "VLOOP_WHEELS=\"$wheels\""
    echo "VLOOP_XZ_SHA256=$xz_sha"
    echo "VLOOP_STORED_SHA256=$stored_sha"
  } > "$last/vloop-manifest.sh"
  mkdir -p .vcarry-images && cp "$S"/images/*.whl .vcarry-images/ && (cd .vcarry-images && sha256sum *.whl > SHA256SUMS)
  mkdir -p .vcarry-ray && cp "$S"/ray/out/*.whl .vcarry-ray/ && (cd .vcarry-ray && sha256sum *.whl > SHA256SUMS)
  for d in .vcarry[0-9]*/; do
    (cd "$d" && find . -maxdepth 1 \( -name 'vllm.whl.xz.part-*' -o -name '*.whl' \) -printf '%f\0' | sort -z |
      xargs -0 -r sha256sum)
  done > "$last/SHA256SUMS"
  [ "$(wc -l < "$last/SHA256SUMS")" = $(( $(echo $names | wc -w) + $(echo $wheels | wc -w) )) ] ||
    { echo "SHA256SUMS does not list every part and wheel"; exit 1; }
  _bytes() { find "$1" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}'; }
  for d in .vcarry*; do
    [ "$(_bytes "$d")" -le $room ] || { echo "$d is over $room bytes"; exit 1; }
  done

  echo
  echo "vLLM pruned wheel (members stored): $(stat -c %s "$stored") bytes, sha256 $stored_sha"
  echo "  travels as vllm.whl.xz: $(stat -c %s "$xzf") bytes, sha256 $xz_sha"
  echo "$(echo $wheels | wc -w) other wheels: $(cat "$last"/*.whl | wc -c) bytes"
  echo "repo itself sends $tree bytes per call; room per call $room bytes"
  for d in .vcarry*; do
    printf '  %-9s %10d bytes (%5.1f MiB, %2d files); with the repo %5.1f MiB\n' "$d" "$(_bytes "$d")" \
      "$(_bytes "$d" | awk '{print $1/1048576}')" "$(ls "$d" | wc -l)" "$(_bytes "$d" | awk -v t="$tree" '{print ($1+t)/1048576}')"
  done
  echo
  echo "Send these $n commands to the GPU machine back to back:"
  for k in $(seq 1 $((n-1))); do
    echo "  $k: carry [\".vcarry$k\"]  command: mkdir -p /tmp/vparts && cp .vcarry$k/* /tmp/vparts/ && ls /tmp/vparts"
  done
  echo "  (vLLM with images: one more call before the last, carry [\".vcarry-images\"]  command: mkdir -p /tmp/vparts-images && cp .vcarry-images/* /tmp/vparts-images/)"
  echo "  (rl ppo-ray: one more call before the last, carry [\".vcarry-ray\"]  command: mkdir -p /tmp/vparts-ray && cp .vcarry-ray/* /tmp/vparts-ray/)"
  echo "  $n: carry [\"$last\"]  command: source $last/vllm-loop-on-device.sh install && <your command>"
  echo "     e.g. ... install && python3 benchmarks/rl_phases.py --rollout_engine vllm"
  echo "Later calls on the same warm machine (no carry): source /tmp/vllm-loop-on-device.sh env && <your command>"
}

_vl_env() {  # from the repo root
  local src; src=$(ls -d "$PWD"/packages/*/src 2>/dev/null | paste -sd:)
  [ -n "$src" ] || echo "vllm-loop-on-device.sh env: no packages/*/src under $PWD (source it from the repo root)" >&2
  export PYTHONPATH=$VLOOP_SITE${src:+:$src}
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
         DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg MPLCONFIGDIR=/tmp/mplconfig \
         RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device README's rule
}

_vl_install() {  # on the device, from the repo root, in the call that carries the last folder
  local here w t0=$SECONDS
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  # sourced from /tmp (a reinstall on the same warm machine): the manifest and parts are in $VLOOP_DIR
  [ -f "$here/vloop-manifest.sh" ] || here=$(cd "$VLOOP_DIR" 2>/dev/null && pwd) || here=
  [ -f "$here/vloop-manifest.sh" ] || { echo "no vloop-manifest.sh: source the copy in the last .vcarry folder"; return 1; }
  # shellcheck disable=SC1091
  . "$here/vloop-manifest.sh"
  if [ "$here" != "$(mkdir -p "$VLOOP_DIR" && cd "$VLOOP_DIR" && pwd)" ]; then cp "$here"/* "$VLOOP_DIR"/ || return 1; fi
  cp "$here/vllm-loop-on-device.sh" /tmp/vllm-loop-on-device.sh 2>/dev/null || true
  local stamp="$VLOOP_SITE/.vloop-installed" id="$VLOOP_STORED_SHA256 $VLOOP_WHEELS"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$id" ]; then
    (cd "$VLOOP_DIR" && sha256sum -c --quiet SHA256SUMS) ||
      { echo "parts missing or corrupt in $VLOOP_DIR ($(ls "$VLOOP_DIR" | grep -c part-) parts there): send calls 1..N-1 again, then this one"; return 1; }
    local whl="$VLOOP_DIR/$VLLM_WHEEL_NAME" p files=()
    for p in $VLOOP_PARTS; do files+=("$VLOOP_DIR/$p"); done
    if command -v xz >/dev/null; then
      cat "${files[@]}" | xz -d -T0 > "$whl" || return 1
    else
      cat "${files[@]}" | "$VLOOP_PY" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 22)" > "$whl" || return 1
    fi
    echo "$VLOOP_STORED_SHA256  $whl" | sha256sum -c - || return 1
    files=("$whl"); for w in $VLOOP_WHEELS; do files+=("$VLOOP_DIR/$w"); done
    rm -f "$stamp"
    "$VLOOP_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$VLOOP_SITE" "${files[@]}" || return 1
    rm -f "$whl"
    echo "$id" > "$stamp"
  fi
  local extra sums
  for extra in /tmp/vparts-images /tmp/vparts-ray; do  # vLLM with images (MM_DEPS), Ray: calls of their own
    [ -f "$extra/SHA256SUMS" ] || continue
    sums=$(sha256sum "$extra/SHA256SUMS" | cut -d' ' -f1)
    [ "$(cat "$extra/.installed" 2>/dev/null)" = "$sums" ] && continue  # these very wheels are in already
    (cd "$extra" && sha256sum -c --quiet SHA256SUMS) || { echo "$extra: corrupt"; return 1; }
    "$VLOOP_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$VLOOP_SITE" "$extra"/*.whl 2>&1 | grep -v "already exists" | tail -2
    echo "$sums" > "$extra/.installed"
  done
  _vl_env
  echo "installed in $VLOOP_SITE in $((SECONDS - t0)) s; PYTHONPATH and env set"
  "$VLOOP_PY" - <<'PY'
import importlib.metadata as m
def v(p):
    try:
        return m.version(p)
    except m.PackageNotFoundError:
        return "MISSING"
print(", ".join(f"{p} {v(p)}" for p in ("vllm", "deepspeed", "liger-kernel", "torch", "transformers", "tensorboard",
                                         "matplotlib", "ray")))
PY
}

_vl_check() {  # after install/env: import what the loop imports (~30 s with vllm)
  _vl_env
  "$VLOOP_PY" - <<'PY'
import time
t = time.time()
import torch, deepspeed, vllm
import rl_cli.ppo, rl_core.rl.build, rl_rollout.vllm_engine  # noqa: F401
from torch.utils.tensorboard import SummaryWriter  # noqa: F401
import matplotlib.pyplot  # noqa: F401
print(f"check OK in {time.time() - t:.0f} s: torch {torch.__version__} (cuda x{torch.cuda.device_count()}), "
      f"vllm {vllm.__version__}, deepspeed {deepspeed.__version__}")
PY
}

case "${1:-}" in
  prepare) ( _vl_prepare ) ;;
  install) _vl_install ;;
  env) _vl_env ;;
  check) _vl_check ;;
  *) echo "usage: bash $0 prepare (here) | source .vcarryN/vllm-loop-on-device.sh install (device, last call) |" \
          "source /tmp/vllm-loop-on-device.sh env | bash /tmp/vllm-loop-on-device.sh check"
     return 2 2>/dev/null || exit 2 ;;
esac
