#!/usr/bin/env bash
# On the GPU machine, from a copy of the repository: benchmarks.gpu_network (the whole network, every
# role its own process, on this host's GPUs). Output under $OUT: preflight.log, gpu_network.log, result.json,
# report.png, net.tgz (every run's role logs and records).
#   carried, git-ignored: .whl and .whl18 (pydantic, zstandard, blake3, cryptography, libp2p 0.8.1's
#   closure for the GPU's Python 3.12) and .gpumodel (SmolLM2's tokenizer files: the random checkpoint's
#   tokenizer; the weights themselves cannot travel).
#   MODEL=random:qwen3-moe-small KS=1,0 STEPS=12 RUN_S=200 K_S=90 ARGS="..." bash benchmarks/gpu_network_device.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl18/*.whl \
  || echo "wheels not installed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
timeout 150 python3 -m benchmarks.gpu_preflight > $OUT/preflight.log 2>&1; tail -1 $OUT/preflight.log | cut -c1-3000
if ! tail -1 $OUT/preflight.log | grep -q '"ok": true'; then echo "preflight failed: no network run"; exit 1; fi
NET=/tmp/net; rm -rf $NET  # a warm machine keeps /tmp: a new run starts clean
keep() {  # a call brings back at most 8 files: results at the top, every role's log and record in one archive,
  # never the shardcast stores or the checkpoint (GBs)
  [ -d $NET ] || return 0
  cp $NET/result.json $NET/report.png $OUT/ 2>/dev/null
  (cd $NET && find . \( -name '*.json' -o -name '*.jsonl' -o -name 'log.txt' -o -name '*.csv' -o -name 'run.toml' \) \
    -not -path './model/*' -not -path '*/shardcast/*' -size -20M -print0 | tar czf $OUT/net.tgz --null -T - 2>/dev/null)
}
( while sleep 15; do keep; done ) &  # a call cut short by the device's limit still brings back what was written
timeout ${RUN_S:-200} python3 -m benchmarks.gpu_network --device cuda --model ${MODEL:-random:qwen3-moe-small} \
  --dtype ${DTYPE:-bfloat16} --tokenizer-from .gpumodel --ks ${KS:-1,0} --steps ${STEPS:-12} --warmup 2 \
  --timeout ${K_S:-90} --out $NET ${ARGS:-} > $OUT/gpu_network.log 2>&1
echo "gpu_network rc=$?"; tail -c 6000 $OUT/gpu_network.log
keep
du -sh $OUT
