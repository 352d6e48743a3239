# One entry point for set-up, checks and benchmarks. Every target installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: system-deps venv lint typecheck test test-vllm demo bench bench-pipeline bench-api bench-generation clean

# The CPU build of torch goes in first: the package's torch range then resolves to it and
# nothing pulls a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# What the tests run for real, from the system's packages: redis-server (each test session
# starts its own on a free loopback port), promtool (checks the /metrics output), and headless
# Chromium with its driver (the dashboard's browser test).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
SYSTEM_TOOLS := redis-server:redis-server promtool:prometheus chromium:chromium chromedriver:chromium-driver
system-deps:
	@missing=$$(for pair in $(SYSTEM_TOOLS); do command -v $${pair%%:*} >/dev/null || echo $${pair#*:}; done); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing"; \
		$(SUDO) apt-get update -qq && \
		$(SUDO) apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy kpo_core services

test: system-deps lint typecheck
	$(VENV)/bin/pytest --ignore=tests/services/generation/test_vllm_backend.py

# The vLLM backend's tests, in their own virtualenv with the CPU build of vLLM (large: ~4 GB).
test-vllm:
	bash scripts/setup_vllm_venv.sh
	.venv-vllm/bin/python -m pytest tests/services/generation/test_vllm_backend.py

# The main job: a real asynchronous KPO run on the built-in task with the tiny model (~5 min on
# 2 cores). Each run gets its own output directory under runs/.
demo: $(STAMP)
	$(VENV)/bin/kpo run examples/demo.yaml --out runs/demo-$$(date +%Y%m%d-%H%M%S)

bench: $(STAMP) bench-pipeline
	$(PY) benchmarks/bench_kalman.py
	$(PY) benchmarks/bench_losses.py

bench-pipeline: $(STAMP)
	$(PY) benchmarks/bench_pipeline.py

bench-api: $(STAMP) system-deps
	$(PY) benchmarks/bench_api.py

# hf and vllm in the same run: the vLLM environment has both.
bench-generation:
	bash scripts/setup_vllm_venv.sh
	.venv-vllm/bin/python benchmarks/bench_generation.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
