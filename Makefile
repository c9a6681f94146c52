# dflash-ops: the commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
APT_PKGS := lxc openssh-server sudo logrotate
PYTEST_ARGS ?=
# make test's xdist workers: its tests wait on playbooks, sshd and trainers, but what they wait on runs
# on the same cores (containers, sshd, torch), so one worker more than the cores: 4 workers on 2 cores
# loaded them to 9-12 and turned the waits into CPU contention. Each test file stays on one worker, in
# order (--dist loadfile).
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
# make test-reliability's: its trials wait on playbooks and trainers too; each file stays on one worker
# with its own fleet, so a file's trials never share a container with another file's.
RELIABILITY_WORKERS ?= 3
# The three randomised trials at full count (decoys, killed deploys, concurrent restarts): 80 minutes of one
# worker's time together, 30 at least side by side. make test-reliability leaves them to their own target,
# so that the rest of the suite stays within 45 minutes; make test and the slice run them at the fast counts.
RELIABILITY_LONG := tests/reliability/test_decoys.py tests/reliability/test_killed_deploys.py \
  tests/reliability/test_concurrent_restarts.py

.PHONY: help setup mlflow-server prometheus-tools peer-suites compat-venv serve-check regenerate-check rehearsal test test-prometheus test-reliability test-reliability-long test-reliability-slice test-flaky test-under-load lint ee-context ee bench demo demo-fleet sim-up sim-down clean

help: ## List the targets.
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'

setup: $(STAMP) ## Install apt packages (lxc, openssh-server, sudo, logrotate) and the pinned venv; silent when done.
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "setup: apt-get install$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

$(STAMP): pyproject.toml
	@echo "setup: building $(VENV) with the pinned dependencies"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip > $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
	@$(PY) -m pip install -q -e '.[dev]' >> $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
	@touch $@

# ansible-core's and community.proxmox's own connection test suites, from their sdists on the package index
# at the versions the venv runs (tests/pvesim/test_peer_suites.py runs them with an inventory of ours).
peer-suites: setup ## Fetch the connection test suites of ansible-core and community.proxmox (silent when there).
	@$(PY) scripts/peer_suites.py

# ansible-core 2.20 and 2.21 (the `ansible` 13 and 14 packages, with community.proxmox 1.6.0 and 2.0.0) need
# Python 3.12+: Debian 13's python3.13, built once from its source package into ~/.cache/dflash-ops (minutes),
# and a venv of it for each line, .cache/ansible13-venv and .cache/newest-venv (scripts/newest_venv.py).
.PHONY: newest-venv test-newest
newest-venv: ## Build Python 3.13 (once a machine) and the venvs of ansible 13 and 14 on it (silent when there).
	@python3 scripts/newest_venv.py

# The tests stay in $(VENV) (pvesim, the containers' trainer); DFLASH_ANSIBLE_BIN makes every Ansible program
# they start that venv's: ansible-core's and community.proxmox's connection suites at its versions, the
# connection's own tests, the declared ranges, community.proxmox's unit suite with docs/patches/ (2.x), and on
# the newest line the playbook tests too.
NEWEST_LINES := ansible13-venv newest-venv
NEWEST_TESTS := tests/pvesim/test_peer_suites.py tests/pvesim/test_connection.py
test-newest: setup newest-venv ## The connection suites and tests on ansible-core 2.20 and 2.21, the playbook tests on 2.21.
	@for v in $(NEWEST_LINES); do DFLASH_ANSIBLE_BIN=$(abspath .cache)/$$v/bin $(PY) scripts/peer_suites.py || exit; done
	DFLASH_ANSIBLE_BIN=$(abspath .cache)/ansible13-venv/bin $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile \
	  $(NEWEST_TESTS) $(PYTEST_ARGS)
	DFLASH_ANSIBLE_BIN=$(abspath .cache)/newest-venv/bin $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile \
	  $(NEWEST_TESTS) tests/roles/test_playbooks.py $(PYTEST_ARGS)

# transformers 4.57.1 (what the public DFlash code pins) beside torch 2.13.0, from the package index
# (tests/dflash/serve/test_export_compat.py reloads an export under it; it skips while this venv is missing).
# MLflow's tracking server (the full mlflow package: Flask, SQLAlchemy, pandas, scikit-learn, pyarrow 25; about
# 850 MB, minutes the first time) in a venv of its own: its pyarrow pin is not .venv's. The trainer needs only
# the client (.[mlflow], in .[dev]); tests/dflash/training/test_mlflow_tracking.py runs this server on 127.0.0.1.
MLFLOW_SERVER_VENV := .cache/mlflow-venv
mlflow-server: ## Build .cache/mlflow-venv, the MLflow tracking server the tests log to (silent when there).
	@test -x $(MLFLOW_SERVER_VENV)/bin/mlflow || { echo "mlflow-server: building $(MLFLOW_SERVER_VENV)"; \
	  rm -rf $(MLFLOW_SERVER_VENV) && python3 -m venv $(MLFLOW_SERVER_VENV) && \
	  $(MLFLOW_SERVER_VENV)/bin/pip install -q 'mlflow==3.17.2' > $(MLFLOW_SERVER_VENV).log 2>&1 || \
	  { cat $(MLFLOW_SERVER_VENV).log; rm -rf $(MLFLOW_SERVER_VENV); exit 1; }; }

# Debian's prometheus package (prometheus and promtool, static binaries) unpacked into .cache/prometheus, never
# installed: installing it would start a Prometheus on :9090 of the machine. tests/prometheus/tools.py finds them.
PROMETHEUS_DIR := .cache/prometheus
prometheus-tools: ## Unpack Debian's prometheus (promtool, prometheus) into .cache/prometheus, nothing started (silent when there).
	@test -x $(PROMETHEUS_DIR)/usr/bin/promtool || { echo "prometheus-tools: unpacking Debian's prometheus into $(PROMETHEUS_DIR)"; \
	  tmp=$$(mktemp -d) && chmod 755 $$tmp && \
	  { (cd $$tmp && apt-get download -qq -o APT::Sandbox::User=root prometheus) || { apt-get update -qq && (cd $$tmp && apt-get download -qq -o APT::Sandbox::User=root prometheus); }; } && \
	  mkdir -p $(PROMETHEUS_DIR) && dpkg-deb -x $$tmp/prometheus_*.deb $(PROMETHEUS_DIR); rc=$$?; rm -rf $$tmp; exit $$rc; }

compat-venv: ## Build .cache/compat-venv with transformers 4.57.1 for the export tests (silent when there).
	@python3 scripts/compat_venv.py

# vLLM's CPU build beside torch 2.13.0 (about 3.5 GB, minutes to install the first time), then vLLM serves
# the tiny demo target with an exported drafter (tests/serving/test_vllm_serve.py) and its own DSpark loader,
# heads and drafting loop read a DSpark export (tests/serving/test_vllm_dspark.py). Heavy: not in make test.
serve-check: setup ## Build .cache/serve-venv (vLLM for CPU) and check an export served by vLLM (heavy).
	@python3 scripts/serve_venv.py
	$(PY) -m pytest -m serve tests/serving $(PYTEST_ARGS)

# Regeneration on vLLM (`dflash_ops.data regenerate --engine vllm`) in the same venv: its greedy rows against the
# transformers path's, an engine killed mid-job then resumed (tests/serving/test_vllm_regenerate.py), and
# regenerate_data.yml on it in a pvesim container (tests/serving/test_vllm_regenerate_playbook.py).
regenerate-check: setup ## Build .cache/serve-venv and check regeneration on vLLM's CPU engine (heavy).
	@python3 scripts/serve_venv.py
	$(PY) -m pytest -m serve tests/serving/test_vllm_regenerate.py tests/serving/test_vllm_regenerate_playbook.py $(PYTEST_ARGS)

# The first real run's layout at Qwen3-8B's width on CPU (1 target, 2 drafters, ~15 GiB, minutes), each rank's
# peak memory beside dflash_ops.training.memory_fit's prediction (BENCHMARKS.md section 13). Heavy: not in make test.
rehearsal: setup ## Rehearse the pipeline at Qwen3-8B's width on CPU: start, held-out, SIGTERM, resume, export (heavy).
	$(PY) -m pytest -m rehearsal tests/rehearsal -s $(PYTEST_ARGS)

test: setup peer-suites mlflow-server prometheus-tools ## The test suite (unit, pvesim, roles, playbooks, one molecule scenario, reliability's fast subset).
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# A real Prometheus (Debian's binary, on loopback) scrapes node_exporter in a pvesim container whose run writes
# its metrics; the run frozen, the stalled-run alert fires and resolves (tests/prometheus/test_prometheus_alerts.py,
# about 3 minutes). make test runs the fast case: promtool's rule tests and the textfile's format.
# pvesim's containers run the machine's own system, which is where provision.yml finds the container's
# prometheus-node-exporter (their network reaches no package mirror): installed here when missing.
test-prometheus: setup prometheus-tools ## A real Prometheus scrapes a pvesim run: the stalled-run alert fires on a frozen run, resolves after.
	@dpkg -s prometheus-node-exporter >/dev/null 2>&1 || { echo "test-prometheus: apt-get install prometheus-node-exporter"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus-node-exporter >/dev/null; }
	$(PY) -m pytest -m prometheus -rP tests/prometheus $(PYTEST_ARGS)

test-reliability: setup peer-suites ## The reliability suite at docs/RELIABILITY.md's counts and what make test leaves out, less the long trials.
	DFLASH_RELIABILITY_FULL=1 $(PY) -m pytest -n $(RELIABILITY_WORKERS) --dist loadfile -rP \
	  -m 'reliability or reliability_full' $(addprefix --ignore=,$(RELIABILITY_LONG)) $(PYTEST_ARGS)

test-reliability-long: setup ## The three randomised trials at full count: decoys, killed deploys, concurrent restarts.
	DFLASH_RELIABILITY_FULL=1 $(PY) -m pytest -n $(RELIABILITY_WORKERS) --dist loadfile -rP \
	  -m 'reliability or reliability_full' $(RELIABILITY_LONG) $(PYTEST_ARGS)

# One case of every reliability file (tests/reliability/slice_cases.py), at the fast counts: `.ci/run` runs it
# after make test, so a stale helper or a broken fixture of a file make test skips fails CI.
test-reliability-slice: setup ## One case of every reliability file, the cheapest (what .ci/run adds to make test).
	$(PY) -m pytest -n $(RELIABILITY_WORKERS) --dist loadfile -rP -m reliability_slice tests/reliability $(PYTEST_ARGS)

# A flaky test is a bug: rerun it under load until its failure rate shows (scripts/flaky.py).
TEST ?=
RUNS ?= 20
test-flaky: setup ## Rerun TEST (a pytest node id) RUNS times beside a CPU hog per core; print its failure rate.
	@test -n "$(TEST)" || { echo "make test-flaky: name the test, e.g. TEST=tests/modules/test_run_report.py::test_x RUNS=50"; exit 2; }
	$(PY) scripts/flaky.py $(TEST) --runs $(RUNS)

test-under-load: setup peer-suites ## make test beside a CPU hog per core (what a shared CI machine does to it).
	$(PY) scripts/cpu_load.py -- $(MAKE) --no-print-directory test

# ansible-lint finds the dflash.ops roles and modules through ansible.cfg (collections_path = .).
# ansible-test sanity runs each test in a virtualenv of its pinned requirements, from the package index.
lint: setup ## ruff, yamllint, ansible-lint (production profile), ansible-test sanity on dflash.ops.
	$(VENV)/bin/ruff check dflash_ops pvesim ansible_collections tests benchmarks scripts
	$(VENV)/bin/yamllint -s .
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/ansible-lint --offline --profile production \
	  playbooks ansible_collections/dflash/ops/roles ansible_collections/dflash/ops/playbooks \
	  ansible_collections/dflash/ops/galaxy.yml ansible_collections/dflash/ops/meta
	$(PY) scripts/ansible_test_sanity.py

# The execution environment (execution-environment.yml, scripts/ee.py): the collection built from galaxy.yml's
# version, the context written by ansible-builder; `make ee` builds the image with podman (its base image and
# Galaxy's community.proxmox come from the network).
ee-context: setup ## Write the execution environment's build context to ee/context.
	$(PY) scripts/ee.py

ee: setup ## Build the execution environment's image with podman (dflash-ops-ee:<version>, :latest).
	$(PY) scripts/ee.py --build

bench: setup ## Run every benchmark; figures go to BENCHMARKS.md by hand.
	$(PY) -m benchmarks

demo: setup ## Bring up pvesim and tell the stop-deploy-start story.
	PATH=$(abspath $(VENV))/bin:$$PATH bash scripts/demo.sh

demo-fleet: setup ## Grow a pvesim fleet: add a container to the inventory, provision it, deploy to it.
	PATH=$(abspath $(VENV))/bin:$$PATH bash scripts/demo_fleet.sh

sim-up: setup ## Start pvesim (1 node, CT 200, 8 simulated GPUs) and write inventory/sim/hosts.yml.
	$(PY) -m pvesim up

sim-down: ## Stop everything pvesim started.
	$(PY) -m pvesim down

clean: sim-down ## Remove the venv and caches.
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
