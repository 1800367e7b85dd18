# Two entry points: `make demo` (set-up + the main job) and `make test` (set-up + the tests).
# `make setup` builds .venv with the CPU stack exactly as a fresh machine needs it.
PY     ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.rlpad-setup

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml scripts/setup_cpu.sh
	PY=$(PY) bash scripts/setup_cpu.sh $(VENV)
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlpad check
	$(VENV)/bin/python -m rlpad.train --config recipes/grpo_tiny.yaml

test: $(STAMP)
	$(VPY) -m pytest -q --durations=15 tests

bench: $(STAMP)
	$(VENV)/bin/rlpad bench

clean:
	rm -rf $(VENV) build *.egg-info
