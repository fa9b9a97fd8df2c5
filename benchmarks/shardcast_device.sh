#!/usr/bin/env bash
# Runs benchmarks.shardcast on the device host's CPUs with stores on tmpfs.
set -u
# Wheels: pip download --only-binary=:all: --python-version 312 ... pydantic zstandard blake3 cryptography
# safetensors tqdm shardcast==0.3.2 -d runs/shardcast-device/wheels (the host reaches no index).
W=runs/shardcast-device/wheels
python -V; nproc; free -g | head -2; df -h /dev/shm /tmp | tail -2; which wget || echo "no wget"
PY=/opt/torch/.venv/bin/python
$PY -m pip install -q --no-index --find-links $W pydantic zstandard blake3 cryptography safetensors tqdm 2>&1 | tail -2
rm -rf /tmp/peer-venv; /usr/bin/python3 -m venv /tmp/peer-venv && /tmp/peer-venv/bin/pip install -q --no-index --find-links $W shardcast==0.3.2 2>&1 | tail -2
$PY -c "import torch, aiohttp, numpy, pydantic, zstandard, blake3; print('deps ok', torch.__version__)"
mkdir -p /dev/shm/sc
OMP_NUM_THREADS=1 timeout 540 $PY -m benchmarks.shardcast --gib 1 --clients 8 --uplink-mibps ${UPLINK:-50} \
  --shard-mib ${SHARD:-8} ${EXTRA:-} --workdir /dev/shm/sc --machine ${MACHINE:-h200-host-16cpu} --out $OUT/shardcast-h200-host.json 2>&1 | grep -v " - shardcast.utils - " | tail -40
