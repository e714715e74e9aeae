# Ballast: two commands matter. `make demo` builds the environment and runs the example pipeline end to
# end; `make test` builds it if needed and runs the whole test suite. The rest are conveniences.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

# The embedded default: everything project-local (SQLite metadata, LocalExecutor, local storage).
export BALLAST_HOME ?= $(CURDIR)/.ballast
export AIRFLOW_HOME ?= $(CURDIR)/.airflow
export AIRFLOW__CORE__DAGS_FOLDER ?= $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER ?= $(CURDIR)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES ?= False
export AIRFLOW__CORE__EXECUTOR ?= LocalExecutor
export GX_ANALYTICS_ENABLED ?= False
export TQDM_DISABLE ?= 1

.PHONY: env java slurm browser prometheus postgres redis demo test unit ui lint schema bench constraints clean vendor-uplot

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $@

# Java runs Spark for the spark conversion engine (and its tests); installed from Debian when missing.
java:
	@command -v java >/dev/null || { echo "installing Java 17 (openjdk-17-jre-headless) for Spark"; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends openjdk-17-jre-headless >/dev/null; }

env: $(BIN)/.installed java

# Slurm's daemons and clients, and munge, for the slurm backend's tests (a real cluster of three node
# daemons on this machine: tests/slurm_cluster.py); installed from Debian when missing.
slurm:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || { echo "installing Slurm (slurmctld slurmd slurm-client munge)"; \
	  apt-get update -qq && apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null; }

# Debian's Chromium and its driver, for the stability view's test in a real headless browser.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { echo "installing Chromium (chromium chromium-driver)"; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }

# Debian's Prometheus and promtool, for the alert rules' test on a real training run.
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { echo "installing Prometheus"; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# PostgreSQL's server programs (initdb, pg_ctl) for the production path's test: the machine image's on the
# PATH, or Debian's under /usr/lib/postgresql/<v>/bin, installed when neither is there.
postgres:
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { echo "installing PostgreSQL"; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql >/dev/null; }

# Debian's Redis, the Celery broker of the production path's test.
redis:
	@command -v redis-server >/dev/null || { echo "installing Redis (redis-server)"; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }

demo: env
	$(BIN)/ballast demo

# Two test processes (pytest-xdist), each given a whole test file at a time so that a file's module
# fixtures (a Slurm cluster, an S3 server) start once; the tests marked `alone` run with none beside them
# (tests/conftest.py). TEST_WORKERS=0 runs every test in one process.
TEST_WORKERS ?= 2
test: env slurm browser prometheus postgres redis
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The fast tier: in-process tests of spec, plan, records, launch specs, checkpoints and codecs (under a
# minute; no torchrun, Spark, GX, S3 server or Airflow database). `make test` runs every tier.
unit: $(BIN)/.installed
	$(BIN)/python -m pytest -q -ra -m unit $(PYTEST_ARGS)

# The Airflow UI on the same homes: http://127.0.0.1:$(PORT) (no login; local development only).
PORT ?= 8080
ui: env
	$(BIN)/ballast ui --port $(PORT)

lint: env
	$(BIN)/ballast lint dags/specs

schema: env
	$(BIN)/ballast schema -o spec.schema.json

bench: env
	$(BIN)/ballast bench parse --specs 50 --json bench-parse.json

# Re-resolve the pinned set after changing a direct dependency (then re-check ../shared/STACK.md).
constraints:
	rm -rf /tmp/ballast-resolve && $(PYTHON) -m venv /tmp/ballast-resolve
	/tmp/ballast-resolve/bin/pip install --quiet 'torch==2.13.0' '.[test,postgres]'
	( head -2 constraints.txt; echo 'torch==2.13.0'; /tmp/ballast-resolve/bin/pip freeze --exclude-editable \
	  | grep -v -e '^torch==' -e '^ballast' | sort -f ) > constraints.new && mv constraints.new constraints.txt

clean:
	rm -rf .airflow .ballast

# The chart library the stability view serves (no CDN), from the npm registry: what is committed under
# plugins/ballast/ui/static/uplot/ (see SOURCE there for the tarball's sha256).
UPLOT ?= 1.6.32
vendor-uplot:
	cd $$(mktemp -d) && npm pack --silent uplot@$(UPLOT) && sha256sum uplot-$(UPLOT).tgz && \
	  tar xzf uplot-$(UPLOT).tgz && cp package/dist/uPlot.iife.min.js package/dist/uPlot.min.css package/LICENSE \
	  $(CURDIR)/plugins/ballast/ui/static/uplot/
