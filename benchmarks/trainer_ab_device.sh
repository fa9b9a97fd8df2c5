#!/usr/bin/env bash
# One device call: the trainer role's step (`benchmarks.trainer_profile`) of this tree against an older one, same GPU,
# at two shapes (the 0.52B network's, 49,152 words; 2 layers of Qwen3-30B-A3B, 151,936 words). The older tree goes
# along as an untracked folder (not git-ignored, so the device copy has it), e.g. the commit before the trainer's LM
# head moved to loss positions:
#   rm -rf old && mkdir old && git archive REF node benchmarks protocol verification shardcast | tar x -C old \
#     && rm -rf old/benchmarks/results
#   timeout 330 bash benchmarks/trainer_ab_device.sh        (carry .whl)
# SMALL_ONLY=1: the 0.52B shape alone (half the call), ONLY=1 the 1.87B one; TREES="new old": the other order (the first run of a call
# pays for compiling and autotuning Triton kernels: session 32's old-first A/B read the old forwards 2x slower);
# a tree named new-padded is this tree with --pack off (the change's packing apart from the rest of it)
set -u
[ -d old/node ] || { echo "no old/ tree (see the header)"; exit 2; }
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
[ -d /tmp/site/zstandard ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "wheels not installed"
nvidia-smi -L
timeout 120 env PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -p no:cacheprovider tests/rl/test_micro_batches.py tests/rl/test_router_replay.py > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -2 $OUT/gpu_tests.log
SHAPES=("qwen3-moe-small --vocab-size 49152" "qwen3-30b-a3b-2l --vocab-size 151936")
[ "${SMALL_ONLY:-0}" = 1 ] && SHAPES=("${SHAPES[0]}")
[ -n "${ONLY:-}" ] && SHAPES=("${SHAPES[$ONLY]}")  # ONLY=1: the 151,936-word shape alone
for shape in "${SHAPES[@]}"; do
  for tree in ${TREES:-old new}; do
    dir=$PWD; [ $tree = old ] && dir=$PWD/old
    extra=""; [ $tree = new-padded ] && extra="--pack off"
    name=$(echo $shape | cut -d' ' -f1)-$tree
    (cd $dir && timeout 90 env PYTHONPATH=/tmp/site:$dir python3 -m benchmarks.trainer_profile --shape $shape --steps 3 $extra) > $OUT/trainer_profile-$name.log 2>&1
    echo "$name rc=$?"; tail -1 $OUT/trainer_profile-$name.log | cut -c1-900
  done
done
