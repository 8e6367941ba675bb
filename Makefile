# The course's commands. `make help` lists them.
VENV ?= .venv
PY := $(VENV)/bin/python
# The PATH as the user had it: `make check-gpu` prefers the node's own python3 (its modules' torch).
USER_PATH := $(PATH)
# Examples and tests find torchrun, mpiexec, horovodrun and deepspeed in the venv.
export PATH := $(abspath $(VENV))/bin:$(PATH)
export PYTHONUNBUFFERED := 1
# TensorFlow's INFO/WARNING banner on every import (oneDNN, CPU features) hides the lesson's output.
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: help setup doctor demo test test-all bench figures check-gpu clean slurm-up slurm-down

help:
	@echo "make setup    build .venv: pinned torch/TF/DeepSpeed/MPI, Horovod compiled once and cached"
	@echo "make doctor   what this machine can run (exit 1 if something the examples need is missing)"
	@echo "make demo     every example on 2 CPU ranks over real MNIST digits, then a results table"
	@echo "make test     the test suite (what CI runs); make test-all adds the longest end-to-end runs"
	@echo "make bench    throughput of every framework at 1 and 2 ranks, then the transformer chapter, its splits and (as root) DDP over a network (QUICK=1: short)"
	@echo "make figures  scaling study and learning-rate lesson figures into runs/figures/ (OUT=assets: into the notes)"
	@echo "make check-gpu  each PyTorch lesson a few steps on this node's GPU (the node's own torch), then a table"
	@echo "make slurm-up   a 2-node Slurm cluster on this machine (root; installs Slurm), for real sbatch jobs"
	@echo "make slurm-down stop it"

setup:
	@bash tools/setup_env.sh

# No setup first: the check says what is missing (and that `make setup` builds it), it does not build it.
doctor:
	@if [ -x $(PY) ]; then $(PY) tools/doctor.py; else python3 tools/doctor.py; fi

demo: setup
	@$(PY) tools/demo.py

# PYTEST_ARGS: more pytest flags, e.g. PYTEST_ARGS="--durations=0" for every test's time.
# Two passes. First the test files spread over WORKERS processes (one per core, at most 4: a test mostly
# starts ranks and waits for them), each file whole on one worker (its shared runs made once); then, alone
# on the machine, the tests that time something (marker `serial`). Both always run; either failing fails.
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
# K: only the tests whose names match (pytest -k): make test K=ddp, make test K="transformer and not split".
SUITE = $(PY) -m pytest tests -m "$(1) and not serial" -n $(WORKERS) --dist loadfile --durations=20 \
	$(if $(K),-k "$(K)") $(PYTEST_ARGS); a=$$?; $(PY) -m pytest tests -m "$(1) and serial" --durations=5 \
	$(if $(K),-k "$(K)") $(PYTEST_ARGS); b=$$?; [ $$b = 5 ] && [ -n "$(K)" ] && b=0; exit $$(( a || b ))
test: setup
	@$(call SUITE,not long)

# Everything, the longest end-to-end runs included (about 30 more minutes on 2 cores).
test-all: setup
	@$(call SUITE,(long or not long))

# No setup: on a GPU node the frameworks are the node's (a module); .venv's python only where the
# python3 on the user's PATH has no torch (a laptop). ARGS passes flags: make check-gpu ARGS=--cpu-scaling
check-gpu:
	@if PATH="$(USER_PATH)" python3 -c "import torch" 2>/dev/null; then \
		PATH="$(USER_PATH)" python3 tools/check_gpu.py $(ARGS); else $(PY) tools/check_gpu.py $(ARGS); fi

bench: setup
	@$(PY) tools/bench.py $(if $(QUICK),--quick) && $(PY) tools/bench.py --transformer $(if $(QUICK),--quick) \
		&& $(PY) tools/bench.py --split $(if $(QUICK),--quick) \
		&& if [ "$$(id -u)" = 0 ] || unshare --user --map-root-user --net true 2>/dev/null; then \
		$(PY) tools/bench_network.py $(if $(QUICK),--quick); else echo "bench_network.py skipped: two nodes \
		over a shaped link need network namespaces: root, or a kernel that gives user namespaces (sudo make bench)"; fi

figures: setup
	@$(PY) tools/figures.py $(if $(OUT),--out $(OUT))

slurm-up:
	@bash tools/slurm_cluster.sh up

slurm-down:
	@bash tools/slurm_cluster.sh down

clean:
	rm -rf runs .pytest_cache
