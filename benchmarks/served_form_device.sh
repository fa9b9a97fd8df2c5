#!/usr/bin/env bash
# One device call (results under $OUT): the GPU tests of the weight path and the trainer's step, then the
# whole network in an FP8 run (`benchmarks.gpu_network --fp8 all`: `sim --device cuda`, every role its own
# process on the one GPU) twice in the same call: versions after 0 published in their served form (e4m3 +
# block scales: node/model/served_form.py, what the trainer role does) and, as the peer, in bf16
# (PRIMERL_PUBLISH_FORM=plain, the previous form). Same model, steps and k; compare weight latency, its
# fetch / stage / swap seconds, wire bytes and the store's bytes per version.
#   carried, git-ignored: .whl (make_wheels.sh) and .gpumodel (SmolLM2's tokenizer files)
#   MODEL=random:qwen3-moe-small STEPS=8 RUN_S=200 [ORDER="plain served"] [ARGS="--store-payloads DIR"] [MPS=1] \
#     timeout 590 bash benchmarks/served_form_device.sh
# ENGINE_ALONE=1: also the engine alone on the same workload, same GPU (`engine_alone_tok_s`, `trained_over_engine_alone`)
# MPS=1: the roles reach the GPU through NVIDIA's multi-process service (nvidia-cuda-mps-control), which runs kernels of
# several processes at once instead of giving each its own time slice
# (the first run of a call compiles and autotunes the Triton kernels into the cache the second reuses: run both orders)
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
[ -d /tmp/site/zstandard ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "wheels not installed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; date
if [ "${MPS:-0}" = 1 ]; then  # the roles' processes share the GPU through NVIDIA's multi-process service (no time slices)
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS daemon started" || echo "MPS daemon did not start"
  trap 'echo quit | nvidia-cuda-mps-control; cp -r $CUDA_MPS_LOG_DIRECTORY $OUT/mps-log 2>/dev/null' EXIT
fi
timeout 120 python3 -m pytest -q -p no:cacheprovider ${TEST_FILES:-tests/engine/test_weight_staging_gpu.py tests/rl/test_micro_batches.py} > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
for form in ${ORDER:-served plain}; do
  rm -rf /tmp/net-$form
  env $([ $form = plain ] && echo PRIMERL_PUBLISH_FORM=plain) timeout ${RUN_S:-200} python3 -m benchmarks.gpu_network \
    --device cuda --model ${MODEL:-random:qwen3-moe-small} --dtype bfloat16 --fp8 ${FP8:-all} --tokenizer-from .gpumodel \
    --ks ${KS:-1} --steps ${STEPS:-8} --warmup 2 --batch-groups ${NGROUPS:-32} --group-size 8 --timeout ${K_S:-150} \
    $([ "${ENGINE_ALONE:-0}" = 1 ] || echo --no-engine-alone) --out /tmp/net-$form ${ARGS:-} > $OUT/gpu_network-$form.log 2>&1
  echo "gpu_network $form rc=$?"; date
  cp /tmp/net-$form/result.json $OUT/result-$form.json 2>/dev/null
  cp /tmp/net-$form/report.png $OUT/report-$form.png 2>/dev/null
  (cd /tmp/net-$form 2>/dev/null && find . \( -name '*.json' -o -name '*.jsonl' -o -name 'log.txt' -o -name '*.csv' \) \
    -not -path './model/*' -not -path '*/shardcast/*' -size -20M -print0 | tar czf $OUT/net-$form.tgz --null -T - 2>/dev/null)
  tail -1 $OUT/gpu_network-$form.log | cut -c1-1500
  rm -rf /tmp/net-$form
done
