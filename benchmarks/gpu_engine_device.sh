#!/usr/bin/env bash
# On the GPU machine, from a copy of the repository: DeepGEMM from its pinned source, the CUDA tests,
# then benchmarks.gpu_engine. Output under $OUT.
#   dg.tgz (beside this checkout's root, carried, git-ignored): `git archive b05ed2f deep_gemm` of
#   github.com/deepseek-ai/DeepGEMM plus `git archive eefa171 include/cute include/cutlass` of
#   github.com/NVIDIA/cutlass (DeepGEMM 1.0.0's JIT needs the headers; nothing is vendored here).
#   TESTS="tests/..." BENCH="--sections ..." TEST_S=.. BENCH_S=.. bash benchmarks/gpu_engine_device.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if [ -f dg.tgz ]; then
  DG=/tmp/dg; mkdir -p $DG && tar xzf dg.tgz -C $DG && mv $DG/include/cute $DG/include/cutlass $DG/deep_gemm/include/
  # nvcc 13 dropped the unversioned PFN_cuTensorMapEncodeTiled typedef DeepGEMM's tma_utils.cuh uses
  printf '#!/bin/sh\nN=/usr/local/cuda/bin/nvcc; [ -x "$N" ] || N=$(command -v nvcc)\nexec "$N" -DPFN_cuTensorMapEncodeTiled=PFN_cuTensorMapEncodeTiled_v12000 "$@"\n' > /tmp/nvcc_dg
  chmod +x /tmp/nvcc_dg
  export DG_NVCC_COMPILER=/tmp/nvcc_dg DG_CACHE_DIR=/tmp/dgcache PYTHONPATH=$DG:${PYTHONPATH:-}
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import deep_gemm; print('deep_gemm importable from', deep_gemm.__file__)" || echo "deep_gemm not importable"
timeout ${TEST_S:-150} python3 -m pytest -q -rs -p no:cacheprovider ${TESTS:-tests/engine tests/fp8} > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -25 $OUT/tests.log
timeout ${BENCH_S:-300} python3 -m benchmarks.gpu_engine ${BENCH:-} > $OUT/bench.log 2>&1
echo "bench rc=$?"; grep -v '^{' $OUT/bench.log | tail -40
