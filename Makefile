# The two commands of the README. Each installs what it needs first: torch pinned (a CPU wheel; an
# unpinned torch would pull gigabytes of CUDA packages), then this package and its dependencies.
PYTHON ?= python3
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: install run test test-all test-torch coverage bench fresh-clone

install:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"
	$(PIP) psutil docstring_parser
	$(PIP) --no-deps "litgpt>=0.5"

run: install  ## the main job: a small GPT trained with ZeRO-3 on 2 CPU processes (conf/gpt_zero3.yaml)
	$(PYTHON) -m lightning_zero fit --config conf/gpt_zero3.yaml $(RUN_ARGS)

test: install  ## the formatter and linter (ruff), the architecture contracts (setup.cfg), then the test suite without the `full` matrices, the type check among its runs (tests/README.md)
	ruff format --check .
	ruff check .
	lint-imports
	$(PYTHON) -m pytest -q -m "not full" --durations=15 tests

test-all: install  ## everything, the full matrices, calibrations and long fault timeouts (`full` marker) included, then `make test-torch`
	ruff format --check .
	ruff check .
	lint-imports
	$(PYTHON) -m pytest -q --durations=15 tests
	$(PYTHON) tests/torch_matrix.py

test-torch:  ## the distributed cases under torch 2.11, 2.12, 2.13 and 2.14, a venv each (cached), and a checkpoint across them (tests/torch_matrix.py)
	$(PYTHON) tests/torch_matrix.py $(TORCH_ARGS)

coverage: install  ## `make test` with line coverage of lightning_zero, worker processes included (slower)
	$(PYTHON) -m pytest -q -m "not full" --cov --cov-report=term tests

bench: install  ## DDP vs FSDP2 vs ZeRO-1/2/3 on a ~25M-parameter GPT, 2 CPU ranks
	$(PYTHON) benchmarks/bench_core.py

fresh-clone:  ## `make test` as a newcomer runs it: a clone of HEAD, a fresh venv (tests/fresh_clone.sh; FRESH_ARGS="--busy test-all")
	bash tests/fresh_clone.sh $(FRESH_ARGS)
