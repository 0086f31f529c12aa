# The two quickstart commands; each sets itself up (venv, torch, skyq) and skips that when done.
PY := .venv/bin/python

.PHONY: setup run test lint docs

setup:
	@./scripts/setup.sh

run: setup  ## the main job: GRPO on a tiny MoE, FP8 blockwise, CPU, a few minutes
	$(PY) -m skyq.train $(ARGS)

test: setup  ## the test suite (what CI runs)
	$(PY) -m pytest -q -m "not gpu"

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

docs: setup  ## regenerate docs/configuration.md from the schema's field docstrings
	$(PY) -m skyq.config.docs > docs/configuration.md
