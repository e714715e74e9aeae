# The orchestrator image: Airflow 3 with Ballast's DAG factory, plugins, stages and data checks.
# Build from the repository root:  docker build -f docker/airflow.Dockerfile -t ballast-airflow .
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    AIRFLOW_HOME=/opt/airflow BALLAST_HOME=/opt/ballast \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/ballast-src/dags AIRFLOW__CORE__PLUGINS_FOLDER=/opt/ballast-src/plugins \
    AIRFLOW__CORE__LOAD_EXAMPLES=False GX_ANALYTICS_ENABLED=False TQDM_DISABLE=1

# Java 17: the spark conversion engine runs Spark (local[*], or as the driver for a cluster).
RUN apt-get update && apt-get install -y --no-install-recommends build-essential openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/ballast-src
# Dependencies first (cached layer), pinned by the same constraints file as every other install path.
COPY pyproject.toml constraints.txt README.md ./
COPY plugins/ballast/__init__.py plugins/ballast/__init__.py
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt \
        "torch==2.13.0" ".[postgres,celery]" && pip uninstall -y ballast
COPY . .
RUN pip install --no-deps -e . && useradd --create-home --uid 50000 airflow \
    && mkdir -p "$AIRFLOW_HOME" "$BALLAST_HOME" && chown -R airflow "$AIRFLOW_HOME" "$BALLAST_HOME"
USER airflow
ENTRYPOINT ["airflow"]
CMD ["api-server"]
