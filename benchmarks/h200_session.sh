#!/usr/bin/env bash
# One device call on an H200 (benchmarks' results come back from $OUT): the GPU tests, the cross-device
# fixture generated on the GPU and the CPU fixture judged by the GPU path, then benchmarks.gpu_network.
#   carried, git-ignored: .whl (make_wheels.sh: pydantic, zstandard, blake3, cryptography, libp2p's closure)
#   and .gpumodel (SmolLM2's tokenizer files, no config.json: the random checkpoint's tokenizer).
#   MODEL=random:qwen3-moe-small KS=1,0 STEPS=10 NGROUPS=32 K_S=150 TESTS=1 bash benchmarks/h200_session.sh
#   SHM=1: the shared store's payloads and the coordinator's state on /dev/shm when it has >= 45 GB free
#   (the roles' one disk held the coordinator's fsyncs behind 10 GB version writes: docs/scale.md, session 22)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || echo "wheels not installed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
X=/tmp/extra; rm -rf $X; mkdir -p $X
if [ "${TESTS:-1}" = 1 ]; then
  # TEST_FILES replaces the default set; GPU_TESTS adds to it
  timeout 300 python3 -m pytest -q -ra -p no:cacheprovider ${TEST_FILES:-tests/verification/test_judging_on_device.py \
    tests/engine/test_cuda_engine_gpu.py tests/engine/test_memory_plan.py tests/verification/test_cross_device.py \
    tests/engine/test_sparse_delta.py tests/verification/test_mixed_many.py tests/verification/test_measure_rows.py \
    tests/node/test_resident_policy_delta.py} \
    ${GPU_TESTS:-} > $X/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $X/gpu_tests.log
fi
if [ "${FIXTURE:-1}" = 1 ]; then
  timeout 200 python3 -m benchmarks.cross_device_fixture --device cuda --out $X/fixture-h200 > $X/fixture.log 2>&1
  echo "fixture rc=$?"; tail -1 $X/fixture.log | cut -c1-600
  timeout 120 python3 -m benchmarks.cross_device_fixture --judge tests/fixtures/cross_device --device cuda \
    > $X/judge_cpu_fixture_on_gpu.log 2>&1; echo "judge rc=$?"; tail -1 $X/judge_cpu_fixture_on_gpu.log | cut -c1-600
fi
(cd /tmp && tar czf $OUT/extra.tgz extra)
[ "${NET:-1}" = 1 ] || exit 0
if [ "${PREFLIGHT:-1}" = 1 ]; then  # PREFLIGHT=0: a later call on a machine whose roles already started
  timeout 150 python3 -m benchmarks.gpu_preflight > $OUT/preflight.log 2>&1; tail -1 $OUT/preflight.log | cut -c1-600
fi
NET=/tmp/net; rm -rf $NET
if [ "${SHM:-0}" = 1 ]; then  # payloads and the coordinator's state on tmpfs, where it has room for a few 10 GB versions
  F=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9); echo "/dev/shm: ${F}G free"
  [ "${F:-0}" -ge 45 ] && ARGS="${ARGS:-} --store-payloads /dev/shm/primerl-payloads --coordinator-state /dev/shm/primerl-coordinator"
  echo "ARGS=${ARGS:-}"
fi
keep() {
  [ -d $NET ] || return 0
  cp $NET/result.json $NET/report.png $OUT/ 2>/dev/null
  (cd $NET && find -L . \( -name '*.json' -o -name '*.jsonl' -o -name 'log.txt' -o -name '*.csv' -o -name 'run.toml' \) \
    -not -path './model/*' -not -path '*/shardcast/*' -size -20M -print0 | tar czf $OUT/net.tgz --null -T - 2>/dev/null)
}
( while sleep 15; do keep; done ) &
KEEPER=$!
timeout ${RUN_S:-420} python3 -m benchmarks.gpu_network --device cuda --model ${MODEL:-random:qwen3-moe-small} \
  --dtype ${DTYPE:-bfloat16} --tokenizer-from .gpumodel --ks ${KS:-1,0} --steps ${STEPS:-10} --warmup 2 \
  --batch-groups ${NGROUPS:-32} --group-size 8 --timeout ${K_S:-150} --out $NET ${ARGS:-} > $OUT/gpu_network.log 2>&1
echo "gpu_network rc=$?"; kill $KEEPER 2>/dev/null; keep; tail -c 3000 $OUT/gpu_network.log
