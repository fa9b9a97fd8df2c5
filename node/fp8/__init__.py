"""Block-scaled FP8 (e4m3, DeepSeek-V3 layout) as both sides use it: quantisation (`quantize`), the
GEMMs and grouped expert GEMMs with their backends (`ops`: Triton `kernels`, `deepgemm`, a torch
reference). The serving engine (node/engine/fp8/model.py) and FP8 training (node/rl/fp8.py) build on
these and import nothing from each other."""
