#!/usr/bin/env bash
# One device call on an H200 for the validator's judging and the trainer's publication (issue 24): the
# judging GPU tests, benchmarks.validator_speed (the 5.2B qwen3-30b-a3b-8l shape, 512 rollouts: completions
# of 40 tokens, then heavy-tailed ones up to 1,000 with LONG=1), benchmarks.publish_speed (the 5.2B model's
# 9.66 GiB bf16 payload, on the disk, and on /dev/shm with SHM=1; the payload file mapped, then pwritten), and
# with LEARN_S=N the tiny model learning `reverse` in `sim --device cuda` for at most N seconds. With
# BEFORE=DIR (a checkout of an earlier commit carrying this one's benchmark files) validator_speed also runs
# there first, in the same call. Carried, git-ignored: .whl (make_wheels.sh). Results come back in $OUT.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || echo "wheels not installed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; free -g | head -2; df -h /tmp /dev/shm | tail -2
timeout 240 python3 -m pytest -q -ra -p no:cacheprovider tests/verification/test_judging_on_device.py \
  tests/verification/test_cross_device.py ${GPU_TESTS:-} > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
if [ -n "${BEFORE:-}" ]; then
  (cd $BEFORE && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m benchmarks.validator_speed --device cuda \
    --profile $OUT/validator_speed-before.prof --out $OUT/validator_speed-before-h200.json > $OUT/validator_speed-before.log 2>&1)
  echo "validator_speed before rc=$?"; tail -1 $OUT/validator_speed-before.log | cut -c1-400
fi
timeout 150 python3 -m benchmarks.validator_speed --device cuda --profile $OUT/validator_speed.prof \
  --out $OUT/validator_speed-h200.json > $OUT/validator_speed.log 2>&1
echo "validator_speed rc=$?"; tail -1 $OUT/validator_speed.log | cut -c1-1500
if [ "${LONG:-0}" = 1 ]; then
  timeout 200 python3 -m benchmarks.validator_speed --device cuda --new-tokens 1000 --lengths pareto \
    --profile $OUT/validator_speed-long.prof --out $OUT/validator_speed-long-h200.json > $OUT/validator_speed-long.log 2>&1
  echo "validator_speed long rc=$?"; tail -1 $OUT/validator_speed-long.log | cut -c1-1500
fi
wheres=disk; [ "${SHM:-1}" = 1 ] && wheres="disk shm"
for where in $wheres; do
  store=/tmp/publish-store; [ $where = shm ] && store=/dev/shm/publish-store
  rm -rf $store
  timeout ${PUB_S:-120} python3 -m benchmarks.publish_speed --gib 9.66 --versions ${VERSIONS:-3} --store $store \
    --out $OUT/publish_speed-$where-h200.json > $OUT/publish_speed-$where.log 2>&1
  echo "publish_speed $where rc=$?"; tail -1 $OUT/publish_speed-$where.log | cut -c1-900
  rm -rf $store
done
if [ "${LEARN_S:-0}" -gt 0 ]; then
  rm -rf /tmp/learn
  timeout $((LEARN_S + 30)) python3 -m node.cli sim --device cuda --inference-nodes 1 --steps 400 --stop-after-target 0 \
    --timeout $LEARN_S --out /tmp/learn > $OUT/learn.log 2>&1
  echo "learn rc=$?"; tail -c 1500 $OUT/learn.log
  cp /tmp/learn/summary.json $OUT/learn-summary.json 2>/dev/null; cp /tmp/learn/report.png $OUT/learn-report.png 2>/dev/null
  cp /tmp/learn/metrics.jsonl $OUT/learn-metrics.jsonl 2>/dev/null
fi
