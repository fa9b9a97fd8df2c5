#!/usr/bin/env bash
# One device call (results under $OUT): benchmarks.real_scale (the full Qwen3-30B-A3B shape as a 31 GB FP8
# checkpoint: launch, batch-256 decode, RL workload, the validator per claim and pooled, every honest claim's
# figures against the bounds in force + the evidence rows pooled_calibration reads), sized to the card it lands
# on (an 80 GB H100: fewer KV slots, the engine freed before the validator's copy loads; on an H100 host the two
# loads took 131 s each and the call ran out at 470 s: give it the whole 600), then benchmarks.commit_stalls
# on an H200 host's disk (measured on an H100 host in session 19). On an H100 the engine, alone on the card until
# the validator loads, takes 75% of what is free for KV and decodes at batch 128.   carried, git-ignored: .whl (make_wheels.sh) and .gpumodel (SmolLM2's tokenizer files)
#   [KTESTS=0: no kernel tests first] [GPU_TESTS="tests/..."] [RS_S=seconds] [RS_EXTRA="--rl-requests 128"] timeout 590 bash benchmarks/real_scale_device.sh
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
[ -d /tmp/site/zstandard ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "wheels not installed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; date
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$MIB" -gt 100000 ]; then CARD=h200; RS="--kv-share 0.52"; LIMIT=440; else CARD=h100; RS="--kv-share 0.75 --release-engine --decode-batch 128"; LIMIT=470; fi
echo "card $CARD ($MIB MiB): $RS"
if [ "${KTESTS:-1}" = 1 ]; then timeout 150 python3 -m pytest -q -p no:cacheprovider tests/fp8/test_kernels.py tests/fp8/test_quantize.py tests/engine/test_cuda_engine_gpu.py tests/model/test_model.py tests/verification/test_measure_rows.py -k "kernels or cleared or cpu_and_a_gpu or moe_combine or sampler or fused or cudnn" > $OUT/fp8_kernel_tests.log 2>&1; echo "fp8 kernel tests rc=$?"; tail -2 $OUT/fp8_kernel_tests.log; else echo "fp8 kernel tests skipped (KTESTS=0)"; fi
if [ -n "${GPU_TESTS:-}" ]; then  # more GPU test files first (their log comes back as gpu_tests.log)
  timeout 150 python3 -m pytest -q -ra -p no:cacheprovider $GPU_TESTS > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
fi
timeout ${RS_S:-$LIMIT} python3 -m benchmarks.real_scale --dir /tmp/q30 --write $RS ${RS_EXTRA:-} --name ${NAME:-real_scale}-$CARD > $OUT/real_scale.log 2>&1
echo "real_scale rc=$?"; date
grep -v '^{' $OUT/real_scale.log | cut -c1-600 | tail -20
rm -rf /tmp/q30
if [ "$CARD" = h200 ] && [ "${STALLS:-1}" = 1 ]; then  # (an H100 host skips it: nothing to report)
  timeout 80 python3 -m benchmarks.commit_stalls --write-gb 6 --members 4 --dir /tmp/stalls --machine "1x NVIDIA $CARD host (its disk)" --out $OUT/commit_stalls-$CARD.json > $OUT/commit_stalls.log 2>&1
  echo "commit_stalls rc=$?"; grep "^\[" $OUT/commit_stalls.log | cut -c1-400; rm -rf /tmp/stalls
fi
date
