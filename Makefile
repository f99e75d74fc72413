# The README's two commands: `make demo` and `make test`. Both create .venv once and reuse it.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
export RAY_AUTH_MODE ?= token
export RAY_USAGE_STATS_ENABLED ?= 0
DEMO_RUN ?= demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: demo test bench mutate clean azurite

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch would pull gigabytes of CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The demo's data, made once and reused by later demos (delete runs/demo-data to make it again): a
# byte-level BPE trained on the first 4 MB of the standard library's sources, and those sources
# tokenized with it on Ray Data. The venv is an order-only prerequisite: reinstalling keeps the data.
DEMO_DATA   := runs/demo-data
DEMO_CONFIG := configs/demo-bpe.yaml
DEMO_CORPUS := --input stdlib --max-bytes 4000000 --skip-bad

$(DEMO_DATA)/tokenizer/tokenizer.json: | $(STAMP)
	$(PY) -m rayshard data tokenizer train --vocab-size 512 $(DEMO_CORPUS) --out $(DEMO_DATA)/tokenizer

$(DEMO_DATA)/dataset/index.parquet: $(DEMO_DATA)/tokenizer/tokenizer.json | $(STAMP)
	rm -rf $(DEMO_DATA)/dataset  # a dataset of an older tokenizer, or a crashed prepare's attempt
	$(PY) -m rayshard data prepare --tokenizer $(DEMO_DATA)/tokenizer $(DEMO_CORPUS) --out $(DEMO_DATA)/dataset

# The product's story: train on 4 ranks, reshard, resume on 2 ranks, prove nothing changed, and
# hand the result to Hugging Face.
DEMO_TO ?= tp=2
DEMO_TO_FLAGS ?= --dp 1 --fsdp 1 --tp 2
demo: DEMO_NAME := $(DEMO_RUN)
demo: $(STAMP) $(DEMO_DATA)/dataset/index.parquet
	@echo "== 0. data: a 512-id BPE and the standard library's sources tokenized with it, in $(DEMO_DATA) (made once)"
	@echo "== 1. train on 4 ranks (dp2 x tp2), 30 steps, a checkpoint every 10"
	$(PY) -m rayshard train --config $(DEMO_CONFIG) --run $(DEMO_NAME)
	@echo "== 2. dry run: what 2 ranks ($(DEMO_TO)) would read from step 10, no data moved"
	$(PY) -m rayshard ckpt plan $(DEMO_NAME)@10 --to $(DEMO_TO)
	@echo "== 3. offline reshard of step 10 to $(DEMO_TO), on Ray actors; digests are layout-independent"
	$(PY) -m rayshard ckpt reshard $(DEMO_NAME)@10 --to $(DEMO_TO) --run $(DEMO_NAME)-resharded
	@$(PY) -m rayshard ckpt digest $(DEMO_NAME)@10 | tail -1
	@$(PY) -m rayshard ckpt digest $(DEMO_NAME)-resharded@10 | tail -1
	$(PY) -m rayshard ckpt diff $(DEMO_NAME)@10 $(DEMO_NAME)-resharded@10
	@echo "== 4. resume step 10 on 2 ranks ($(DEMO_TO)) to step 30, resharding at load time"
	$(PY) -m rayshard train --config $(DEMO_CONFIG) --run $(DEMO_NAME)-resumed --resume $(DEMO_NAME)@10 $(DEMO_TO_FLAGS)
	@echo "== 5. loss continuity against the uninterrupted run, and the picture"
	$(PY) -m rayshard ckpt plot-resume --run $(DEMO_NAME) --run $(DEMO_NAME)-resumed --reference $(DEMO_NAME) \
		--out runs/$(DEMO_NAME)-resume.png
	@echo "== 6. the same checkpoint resumed in bf16 with selective activation checkpointing on fsdp2: checkpoints"
	@echo "      hold the float32 master state, so precision is a choice at resume time too (stages 1-5 stay fp32:"
	@echo "      their exact continuity across layouts above is what bf16's rounding would blur)"
	$(PY) -m rayshard train --config $(DEMO_CONFIG) --run $(DEMO_NAME)-bf16 --resume $(DEMO_NAME)@10 --steps 30 \
		--dp 1 --fsdp 2 --tp 1 --precision bf16 --ac selective
	@echo "== 7. export step 30 to a Hugging Face directory (weights, config and the BPE tokenizer), and"
	@echo "      generate a line with transformers' AutoTokenizer + AutoModelForCausalLM from it"
	$(PY) -m rayshard ckpt export $(DEMO_NAME)@30 --out runs/$(DEMO_NAME)-hf --no-optimizer
	$(PY) -m rayshard ckpt generate runs/$(DEMO_NAME)-hf --prompt "def " --max-new-tokens 24

test: $(STAMP)
	$(PY) -m pytest

# Azurite, the Azure Storage emulator the Azure tests start: the pinned version from the npm
# registry into build/azurite, once (the tests install it the same way on first use).
azurite: $(STAMP)
	$(PY) -c "import sys; from tests.azure_fixtures import install_azurite as i; sys.exit(0 if i() else i.reason)"

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
