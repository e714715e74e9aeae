# The training image: what runs on a training node (a Kubernetes pod; a Slurm node runs the same
# packages from a venv): `training/` and the `ballast` package's node side (`python -m ballast.node`:
# the cache warm-up from storage, checkpoint sync, the torchrun launcher). No Airflow: `ballast.node`
# imports none of it (tests/test_dags.py checks the parse-time imports; `ballast.node` is pydantic,
# boto3, pyarrow and torch).
# Build from the repository root:  docker build -f docker/training.Dockerfile -t ballast-training .
# For GPUs, base it on an NVIDIA CUDA runtime image and install the matching CUDA build of torch 2.13.0.
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /opt/ballast
COPY constraints.txt pyproject.toml README.md ./
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt \
        "torch==2.13.0" numpy pyarrow tfrecord pydantic pyyaml boto3 prometheus-client
COPY training/ training/
COPY plugins/ plugins/
COPY data_checks/ data_checks/
# The package without its orchestrator dependencies (Airflow, Spark, GX stay on the workers).
RUN pip install --no-deps . && useradd --create-home --uid 50000 trainer
# Non-root; the pod's security context also runs it as 50000 with a read-only root filesystem
# (writable: /tmp, /cache, /work and /dev/shm, all volumes).
USER 50000
ENTRYPOINT ["python", "-m", "ballast.node"]
CMD ["--help"]
