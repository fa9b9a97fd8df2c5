#!/usr/bin/env bash
# On the GPU machine, from a copy of the repository (issue 26, item 2): the cross-device fixture generated
# by the CUDA engine (graphs on), judged by the validator's CPU path and its GPU path; the committed
# CPU-generated fixture judged by the GPU path; then the CI test on the GPU-generated fixture.
#   bash benchmarks/cross_device_device.sh        (S=seconds per step, default 150; generation 240)
# Output under $OUT (6 files): cross_device_h200/ (config.json, model.safetensors, claims.jsonl,
# provenance.json: commit them as tests/fixtures/cross_device/), cross_device.jsonl (one JSON line per
# step, "step" first), cross_device.log (progress, rc of each step, the test's output).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
X=$OUT/cross_device_h200 J=$OUT/cross_device.jsonl L=$OUT/cross_device.log
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" >> $L 2>&1

step() {  # step NAME SECONDS ARGS...: one run of the benchmark, its JSON line tagged with NAME
  local name=$1 secs=$2; shift 2
  timeout $secs python3 -m benchmarks.cross_device_fixture "$@" > /tmp/cross_device_step.out 2>> $L
  echo "$name rc=$?" | tee -a $L
  tail -1 /tmp/cross_device_step.out | grep '^{' | sed "s/^{/{\"step\": \"$name\", /" >> $J
}

step generate_cuda 240 --device cuda --out $X
step gpu_rollouts_judged_on_cpu ${S:-150} --judge $X --device cpu
step gpu_rollouts_judged_on_gpu ${S:-150} --judge $X --device cuda
step cpu_rollouts_judged_on_gpu ${S:-150} --judge tests/fixtures/cross_device --device cuda
# the CI test, on this copy only, with the GPU-generated fixture in the committed one's place
if [ -f $X/claims.jsonl ]; then
  cp $X/* tests/fixtures/cross_device/
  timeout ${S:-150} python3 -m pytest -q -rs -p no:cacheprovider tests/verification/test_cross_device.py >> $L 2>&1
  echo "ci_test_on_gpu_fixture rc=$?" | tee -a $L
fi
cut -c1-700 $J
tail -15 $L
