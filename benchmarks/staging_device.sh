#!/usr/bin/env bash
# One device call (any one GPU): the staging path's GPU tests, then benchmarks.stage_speed (mirror, runs and pieces
# alone and beside the wire neighbour; mirror and runs beside the pure-Python stand-in for the engine's thread).
#   carried, git-ignored: .whl (make_wheels.sh). Results under $OUT.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || echo "wheels not installed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; nproc
timeout 240 python3 -m pytest -q -ra -p no:cacheprovider tests/engine/test_weight_staging_gpu.py tests/engine/test_pinned_ring.py \
  tests/engine/test_mirror_plan.py tests/engine/test_cuda_engine_gpu.py tests/node/test_resident_policy.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
timeout ${SPEED_S:-200} python3 -m benchmarks.stage_speed --threads 4 --repeats 2 --conditions ${CONDITIONS:-alone,wire} \
  --out $OUT/stage_speed.json > $OUT/stage_speed.log 2>&1
echo "stage_speed rc=$?"; tail -1 $OUT/stage_speed.log | cut -c1-1500
if [ "${THREADS8:-1}" = 1 ]; then  # the mirror's pieces on twice the ring threads
  timeout ${SPEED8_S:-120} python3 -m benchmarks.stage_speed --threads 8 --repeats 2 --paths mirror --conditions alone,wire \
    --out $OUT/stage_speed_8threads.json > $OUT/stage_speed_8threads.log 2>&1
  echo "stage_speed 8 threads rc=$?"; tail -1 $OUT/stage_speed_8threads.log | cut -c1-800
fi
[ "${GIL:-1}" = 1 ] || exit 0
timeout ${GIL_S:-150} python3 -m benchmarks.stage_speed --threads 4 --repeats 1 --paths mirror,runs --conditions gil \
  --out $OUT/stage_speed_gil.json > $OUT/stage_speed_gil.log 2>&1
echo "stage_speed gil rc=$?"; tail -4 $OUT/stage_speed_gil.log | cut -c1-1500
