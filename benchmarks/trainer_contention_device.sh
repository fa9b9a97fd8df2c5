#!/usr/bin/env bash
# One device call: is the trainer role's step slower in the network than alone (session 30-31: ~3 s in the
# 0.52B network for what `benchmarks.trainer_profile` does in 1.2 s) because of the host's CPUs or the shared GPU?
# The trainer's step (router replay, as the role trains) alone; beside 12 threads compressing (what a version's
# encode does on the trainer's host while the next step trains); beside the inference role's engine decoding on
# the same GPU (`benchmarks.validator_speed` generating, in a loop). Then the network itself, whose trainer rows
# now split `batch_s` (the host builds the batch) from `update_s` (Trainer.train_step).
#   timeout 560 bash benchmarks/trainer_contention_device.sh        (carry .whl and .gpumodel)
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
[ -d /tmp/site/zstandard ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "wheels not installed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
profile() {  # $1: the condition's name
  timeout 120 python3 -m benchmarks.trainer_profile --shape qwen3-moe-small --steps 5 > $OUT/trainer_profile-$1.log 2>&1
  echo "$1 rc=$?"; tail -1 $OUT/trainer_profile-$1.log | cut -c1-700
}
profile alone
python3 -c "
import os, zstandard
data = os.urandom(1 << 26)
c = zstandard.ZstdCompressor(level=3, threads=12)
while True:
    c.compress(data)" &
HOG=$!
profile cpu12
kill $HOG; wait $HOG 2>/dev/null
( while :; do python3 -m benchmarks.validator_speed --device cuda --shape qwen3-moe-small --rollouts 512 \
    --new-tokens 400 --lengths pareto > /dev/null 2>&1; done ) &
GEN=$!
sleep 40  # the engine built and generating
profile gpu-engine
kill $GEN 2>/dev/null; pkill -f benchmarks.validator_speed; wait 2>/dev/null
timeout 200 sh -c "top -b -c -w 250 -d 3 -n 60 | grep -E \"^top|Cpu|python\"" > $OUT/top.log 2>&1 &  # each process's CPU share while the network runs
TOP=$!
ORDER=served KS=1 MODEL=random:qwen3-moe-small STEPS=8 RUN_S=150 TEST_FILES=tests/rl/test_micro_batches.py \
  timeout 230 bash benchmarks/served_form_device.sh
kill $TOP 2>/dev/null; true
