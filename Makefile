# visionrl: `make demo` trains the tiny model on the CPU and shows it learned; `make test` runs the suite.
# Both build (or reuse) .venv first.
PY := .venv/bin/python
DEMO_DIR ?= runs/demo
PYTEST_ARGS ?=
# `make test` runs the test files on this many processes (pytest-xdist, a file's tests together so they share its
# Ray session): the integration tests leave a core idle about half the time (waiting on actors and deadlines).
TEST_WORKERS ?= 2

.PHONY: setup demo demo-judge demo-zoom test test-fast lint format clean-demo

setup:
	@bash scripts/setup_venv.sh

demo: setup
	@$(PY) -m visionrl.demo --dir $(DEMO_DIR)

# the same task with a tiny judge model as the only reward (README, Rewards)
demo-judge: setup
	@$(PY) -m visionrl.demo --judge --dir runs/demo_judge

# multi-turn episodes: a tiny model learns to call a crop tool before it answers (README, Multi-turn episodes)
demo-zoom: setup
	@$(PY) -m visionrl.demo --task zoom --dir runs/zoom

test: setup
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

test-fast: setup
	@$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	@$(PY) -m ruff check src tests benchmarks scripts
	@$(PY) -m ruff format --check src tests benchmarks scripts
	@$(PY) -m mypy

format: setup
	@$(PY) -m ruff format src tests benchmarks scripts
	@$(PY) -m ruff check --fix src tests benchmarks scripts

clean-demo:
	rm -rf $(DEMO_DIR)
