# The README's two commands: `make demo` and `make test`. Both create .venv once and reuse it.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
export RAY_AUTH_MODE ?= token
export RAY_USAGE_STATS_ENABLED ?= 0
DEMO_RUN ?= demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch would pull gigabytes of CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m cluster train --config configs/demo.yaml --run $(DEMO_RUN)

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/orchestration.py

clean:
	rm -rf $(VENV) runs
