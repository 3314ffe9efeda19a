# The two commands of the README: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv on first use and installs what it needs; later runs reuse it.
# A torch that $(PYTHON) already imports (a CUDA or ROCm build, any >= 2.10) is kept: the venv sees
# the system's packages and pip is held to that torch, never replacing it. Without one, TORCH_SPEC
# is installed (on these CPU machines a local wheel). Offline: README, Install.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
SYSTEM_TORCH = $(shell $(PYTHON) -c "import torch" 2>/dev/null && echo yes)
GPUS = $(shell $(BIN)/python -c "import torch; print(torch.cuda.device_count())")

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(if $(SYSTEM_TORCH),--system-site-packages) $(VENV)
	$(if $(SYSTEM_TORCH),,$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)")
	$(BIN)/python -c "import sys, torch; v = torch.__version__; \
		sys.exit(f'fourfold needs torch >= 2.10; $(PYTHON) has {v}: upgrade it, or set PYTHON to one without torch') \
		if tuple(map(int, v.split('+')[0].split('.')[:2])) < (2, 10) else print(f'torch=={v}')" > $(VENV)/torch.txt
	$(BIN)/python -m pip install --quiet -c $(VENV)/torch.txt -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	@echo "make demo: 8 CPU ranks (gloo) on any machine; on GPUs: fourfold train CONFIG (README)"
	$(BIN)/fourfold demo --train.device cpu

# With 2 or more GPUs the NCCL tests run too, one rank per GPU (one GPU: the kernel tests, in the suite).
# The torch-free tests first, with torch blocked (that they need none is checked so), then the rest.
test: $(VENV)/.installed
	FOURFOLD_NO_TORCH=1 $(BIN)/python -m pytest -q -m torch_free
	$(BIN)/python -m pytest -q -m "not torch_free"
	$(if $(filter-out 0 1,$(GPUS)),$(BIN)/torchrun --nproc-per-node $(GPUS) -m pytest -q tests/gpu -m gpu)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
