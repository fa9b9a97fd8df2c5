#!/usr/bin/env bash
# One device call: the tiny model learns `reverse` in `primerl-node sim --device cuda` (every role a real process,
# trainer / validator / inference node on cuda:0), for at most LEARN_S seconds; summary, metrics, report and every
# role's log come back in $OUT. Carried, git-ignored: .whl (make_wheels.sh).
#   LEARN_S=470 NODES=1 [VSPEED=0] [GPU_TESTS="tests/..."] bash benchmarks/gpu_learn.sh
# GPU_TESTS: test files run first (their log comes back as gpu_tests.log).
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || echo "wheels not installed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
if [ -n "${GPU_TESTS:-}" ]; then
  timeout 150 python3 -m pytest -q -ra -p no:cacheprovider $GPU_TESTS > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
fi
L=/tmp/learn; rm -rf $L
keep() {
  [ -d $L ] || return 0
  for f in summary.json report.png metrics.jsonl; do cp $L/$f $OUT/learn-$f 2>/dev/null; done
  (cd $L && find . \( -name 'log.txt' -o -name 'rounds.jsonl' -o -name 'swaps.jsonl' -o -name 'versions.jsonl' \) \
    -size -20M -print0 | tar czf $OUT/learn-logs.tgz --null -T - 2>/dev/null)
}
( while sleep 20; do keep; done ) &
KEEPER=$!
timeout $((${LEARN_S:-470} + 40)) python3 -m node.cli sim --device cuda --inference-nodes ${NODES:-1} --task reverse \
  --steps ${STEPS:-500} --stop-after-target ${AFTER:-5} --timeout ${LEARN_S:-470} --out $L ${ARGS:-} > $OUT/learn.log 2>&1
echo "learn rc=$?"; kill $KEEPER 2>/dev/null; keep; tail -c 2500 $OUT/learn.log
# The validator's judging of the same tiny model alone, float32 as `sim` runs it and bf16 beside it (session 24's
# suspect for the 6-9 s gaps of this run on an H100: the validator, one core busy all the time). VSPEED=0 skips.
# Their files go back as one archive: a call returns at most 8 files (session 25 lost the float32 run's to that).
if [ "${VSPEED:-1}" = 1 ]; then
  V=/tmp/vspeed; rm -rf $V; mkdir -p $V
  for dt in float32 bfloat16; do
    timeout 120 python3 -m benchmarks.validator_speed --device cuda --shape tiny --dtype $dt --rollouts 512 \
      --profile $V/validator_speed-tiny-$dt.prof --out $V/validator_speed-tiny-$dt.json > $V/validator_speed-tiny-$dt.log 2>&1
    echo "validator_speed $dt rc=$?"; tail -c 600 $V/validator_speed-tiny-$dt.log
  done
  (cd /tmp && tar czf $OUT/validator_speed.tgz vspeed)
fi
