# The README's two commands: `make demo` and `make test`. Both create .venv once and reuse it.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
export RAY_AUTH_MODE ?= token
export RAY_USAGE_STATS_ENABLED ?= 0
DEMO_RUN ?= demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: demo test bench mutate clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch would pull gigabytes of CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The product's story: train on 4 ranks, reshard, resume on 2 ranks, prove nothing changed.
DEMO_TO ?= tp=2
DEMO_TO_FLAGS ?= --dp 1 --fsdp 1 --tp 2
demo: DEMO_NAME := $(DEMO_RUN)
demo: $(STAMP)
	@echo "== 1. train on 4 ranks (dp2 x tp2), 30 steps, a checkpoint every 10"
	$(PY) -m cluster train --config configs/demo.yaml --run $(DEMO_NAME)
	@echo "== 2. dry run: what 2 ranks ($(DEMO_TO)) would read from step 10, no data moved"
	$(PY) -m cluster ckpt plan $(DEMO_NAME)@10 --to $(DEMO_TO)
	@echo "== 3. offline reshard of step 10 to $(DEMO_TO), on Ray actors; digests are layout-independent"
	$(PY) -m cluster ckpt reshard $(DEMO_NAME)@10 --to $(DEMO_TO) --run $(DEMO_NAME)-resharded
	@$(PY) -m cluster ckpt digest $(DEMO_NAME)@10 | tail -1
	@$(PY) -m cluster ckpt digest $(DEMO_NAME)-resharded@10 | tail -1
	$(PY) -m cluster ckpt diff $(DEMO_NAME)@10 $(DEMO_NAME)-resharded@10
	@echo "== 4. resume step 10 on 2 ranks ($(DEMO_TO)) to step 30, resharding at load time"
	$(PY) -m cluster train --config configs/demo.yaml --run $(DEMO_NAME)-resumed --resume $(DEMO_NAME)@10 $(DEMO_TO_FLAGS)
	@echo "== 5. loss continuity against the uninterrupted run, and the picture"
	$(PY) -m cluster ckpt plot-resume --run $(DEMO_NAME) --run $(DEMO_NAME)-resumed --reference $(DEMO_NAME) \
		--out runs/$(DEMO_NAME)-resume.png
	@echo "== 6. the same checkpoint resumed in bf16 with selective activation checkpointing on fsdp2: checkpoints"
	@echo "      hold the float32 master state, so precision is a choice at resume time too (stages 1-5 stay fp32:"
	@echo "      their exact continuity across layouts above is what bf16's rounding would blur)"
	$(PY) -m cluster train --config configs/demo.yaml --run $(DEMO_NAME)-bf16 --resume $(DEMO_NAME)@10 --steps 30 \
		--dp 1 --fsdp 2 --tp 1 --precision bf16 --ac selective

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/orchestration.py

# Mutation testing of the modules that decide correctness, against their fast unit tests; prints
# the score per module and every surviving mutant (docs/mutation-testing.md). Not part of `make
# test`: CPU-heavy, so niced, one module and one worker at a time. MUTATE=checker (words of module
# paths) runs some; MUTATE_ARGS=--report reprints the last scores, --survivors re-runs survivors.
MUTATE ?=
MUTATE_ARGS ?=
mutate: $(STAMP)
	nice -n 10 $(PY) tools/mutate.py $(MUTATE_ARGS) $(MUTATE)

clean:
	rm -rf $(VENV) runs
