#!/usr/bin/env bash
# One device call: is the trainer role's step slowed by what shares its host in the network: the host's CPUs, or
# the GPU the other roles use? (Asked in session 31, after session 30 read its network's steps as 2.5-4x the
# profile's: unlike figures, completion tokens against prompt + completion tokens.)
# The trainer's step (router replay, as the role trains) alone; beside 12 threads compressing (what a version's
# encode does on the trainer's host while the next step trains); beside the inference role's engine decoding on
# the same GPU (`benchmarks.validator_speed` generating, in a loop). Then the network itself, whose trainer rows
# now split `batch_s` (the host builds the batch) from `update_s` (Trainer.train_step).
#   timeout 480 bash benchmarks/trainer_contention_device.sh        (carry .whl and .gpumodel)
# Session 31 (H100): alone 1.060 s, beside CPU load 1.017, beside the engine loop 1.010 (how busy the loop kept the GPU
# was not recorded then: now `util-*.csv`); in the network the update took 1.61 s at k = 1, 1.67 s at k = 0.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
[ -d /tmp/site/zstandard ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "wheels not installed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
L=/tmp/contention; rm -rf $L; mkdir -p $L  # packed into one file at the end (a call brings back only a few files)
profile() {  # $1: the condition's name; the GPU's utilization sampled beside it (was the neighbour busy?)
  timeout 130 nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 500 > $L/util-$1.csv 2>&1 &
  local SMI=$!
  timeout 120 python3 -m benchmarks.trainer_profile --shape qwen3-moe-small --steps 5 > $L/trainer_profile-$1.log 2>&1
  echo "$1 rc=$?"; tail -1 $L/trainer_profile-$1.log | cut -c1-700
  kill $SMI 2>/dev/null
  awk -F', ' '{gsub(/ %/, "", $2); s += $2; n++} END {if (n) printf "  GPU utilization beside it: mean %.0f%% over %d samples\n", s / n, n}' $L/util-$1.csv
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
( while :; do date +%T; python3 -m benchmarks.validator_speed --device cuda --shape qwen3-moe-small --rollouts 512 \
    --new-tokens 400 --lengths pareto 2>&1 | tail -1 | cut -c1-300; done ) > $L/gen-loop.log 2>&1 &
GEN=$!
sleep 40  # the engine built and generating
profile gpu-engine
kill $GEN 2>/dev/null; pkill -f benchmarks.validator_speed; wait 2>/dev/null
timeout 200 sh -c "top -b -c -w 250 -d 3 -n 60 | grep -E \"^top|Cpu|python\"" > $L/top.log 2>&1 &  # each process's CPU share while the network runs
TOP=$!
ORDER=served KS=1 MODEL=random:qwen3-moe-small STEPS=8 RUN_S=150 TEST_FILES=tests/rl/test_micro_batches.py \
  timeout 230 bash benchmarks/served_form_device.sh
kill $TOP 2>/dev/null
(cd /tmp && tar czf $OUT/contention.tgz contention); true
