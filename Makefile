# Two entry points, each bootstrapping its own virtualenv (.venv) on a fresh machine:
#   make demo   run the main job (generation) on the embedded default model
#   make test   check the code with ruff, then run the test suite (a wheel built and installed included)
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "spec_jax needs Python >= 3.12; set PYTHON=python3.12")'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

.PHONY: demo test clean
demo: $(STAMP)
	$(VENV)/bin/spec-jax generate --prompt "def fibonacci(n):" --prompt "The module provides" --max-tokens 128 \
		--max-model-len 512 --ignore-eos --compare \
		--speculative-config '{"method":"eagle3","model":"spec_jax/assets/default/eagle3","num_speculative_tokens":3}'

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV)
