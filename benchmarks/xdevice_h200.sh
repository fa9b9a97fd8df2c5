#!/usr/bin/env bash
# One device call on an H200 (issue 26): false bans on the GPU, detection per submission on the GPU, and
# calibration from the CUDA engine judged by the validator's GPU and CPU paths. Each step under an outer
# timeout; the whole under 9 minutes by default. Output under $OUT: xdevice.log (the steps' rc and last
# lines), <step>.json (its JSON; a step cut by its timeout leaves what it measured: false_bans from its
# checkpoint, the others rewrite their file after every case), <step>.log (progress).
#   carried, git-ignored: .whl (make_wheels.sh: pydantic, zstandard, blake3, cryptography, libp2p's closure),
#   as for benchmarks/h200_session.sh. No DeepGEMM: FP8 expert GEMMs are the Triton kernels (the default).
#   STEPS="false_bans detection calibration" FB_S=260 DET_S=90 CAL_S=170 bash benchmarks/xdevice_h200.sh
#   STEPS=evidence EV_S=400: each claim's evidence (small shape: every case at 3 precisions, honest at batches
#   4 and 256; the 48-layer shape) for `python -m benchmarks.pooled_calibration OUT/evidence.jsonl`
#   (two calls with more room: STEPS=false_bans FB_S=540, then STEPS="detection calibration" DET_S=180 CAL_S=380)
#   On the CPU (a tiny run of every step, for a test): DEVICE=cpu TINY=1 OUT=/tmp/x bash benchmarks/xdevice_h200.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} OMP_WAIT_POLICY=PASSIVE
OUT=${OUT:?set OUT to the output folder}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
mkdir -p $OUT
L=$OUT/xdevice.log
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheels not installed" | tee -a $L
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
{ [ "$DEVICE" = cpu ] || nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } >> $L 2>&1
git log -1 --format='commit %h %s' >> $L 2>/dev/null

if [ "${TINY:-0}" = 1 ]; then  # seconds-sized: the CPU test of this script
  FB="--rollouts 48 --batches 8,16 --cheat-every 3 --shape tiny --precisions bfloat16,fp8-all-bfloat16 --engine builtin-cuda"
  DET="--shape tiny --rollouts 8 --batch 8 --precisions bfloat16"
  CAL="--shapes tiny --precisions bfloat16 --tf32-shape tiny --rounds 1:1,8:1"
  EV="--shape tiny --rollouts 16 --batch 8 --precisions bfloat16" EV48="--shape tiny --rollouts 16 --batch 8 --cases honest"
else
  FB="--rollouts ${FB_ROLLOUTS:-20000}"
  DET="--rollouts ${DET_ROLLOUTS:-128}"
  CAL=""
  EV="--rollouts ${EV_ROLLOUTS:-256}" EV48="--shape qwen3-30b-a3b-48l-e16 --rollouts ${EV48_ROLLOUTS:-128}"
fi
FB_S=${FB_S:-260} DET_S=${DET_S:-90} CAL_S=${CAL_S:-170} EV_S=${EV_S:-400}
# each benchmark stops starting work ~25 s before its step's timeout, so it ends and writes its JSON itself
lead() { echo $(( $1 > 60 ? $1 - 25 : $1 * 2 / 3 )); }

step() {  # step NAME SECONDS COMMAND...: run it, log its rc, keep its last JSON line
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout $secs "$@" > $OUT/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a $L
  grep '^{' $OUT/$name.log | tail -1 | cut -c1-1500 >> $L
}

for s in ${STEPS:-false_bans detection calibration}; do
  case $s in
  false_bans)
    step false_bans $FB_S $PY -m benchmarks.false_bans --device $DEVICE --minutes $(awk "BEGIN{print $(lead $FB_S) / 60}") \
      --checkpoint $OUT/false_bans.jsonl --out $OUT/false_bans.json --evidence $OUT/false_bans_evidence.jsonl $FB
    [ -s $OUT/false_bans.json ] || timeout 60 $PY -m benchmarks.false_bans --report $OUT/false_bans.jsonl \
      --out $OUT/false_bans.json >> $OUT/false_bans.log 2>&1 ;;
  detection)
    step detection $DET_S $PY -m benchmarks.detection_device --device $DEVICE --seconds $(lead $DET_S) \
      --out $OUT/detection.json $DET ;;
  evidence)  # each claim's evidence for the pooled check (benchmarks.pooled_calibration): the small shape at
    # three precisions and every case, its honest rollouts at decode batches 4 and 256, the 48-layer shape
    step evidence_small $(( EV_S * 35 / 100 )) $PY -m benchmarks.detection_device --device $DEVICE \
      --seconds $(lead $(( EV_S * 35 / 100 ))) --out $OUT/detection_evidence.json --evidence $OUT/evidence.jsonl $EV
    for b in 4 256; do
      step evidence_b$b $(( EV_S * 10 / 100 )) $PY -m benchmarks.detection_device --device $DEVICE --cases honest \
        --batch $b --seconds $(lead $(( EV_S * 10 / 100 ))) --out $OUT/detection_b$b.json --evidence $OUT/evidence.jsonl $EV
    done
    step evidence_48l $(( EV_S * 45 / 100 )) $PY -m benchmarks.detection_device --device $DEVICE $EV48 \
      --precisions ${EV48_PRECISIONS:-bfloat16,fp8-all-bfloat16} --seconds $(lead $(( EV_S * 45 / 100 ))) \
      --out $OUT/detection_48l.json --evidence $OUT/evidence.jsonl ;;
  evidence_48l)  # the 48-layer shape alone (EV48_PRECISIONS), EV_S seconds
    step evidence_48l $EV_S $PY -m benchmarks.detection_device --device $DEVICE $EV48 \
      --precisions ${EV48_PRECISIONS:-bfloat16,fp8-all-bfloat16} --seconds $(lead $EV_S) \
      --out $OUT/detection_48l.json --evidence $OUT/evidence.jsonl ;;
  calibration)
    step calibration $CAL_S $PY -m benchmarks.verification_calibration --device $DEVICE --seconds $(lead $CAL_S) \
      --results $OUT/calibration.json $CAL ;;
  *) echo "unknown step $s" | tee -a $L ;;
  esac
done
ls -la $OUT >> $L
tail -c 6000 $L
