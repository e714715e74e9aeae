# The training image: what runs on a training node (a Kubernetes pod; a Slurm node runs the same
# packages from a venv): `training/` and the `ballast` package's node side (`python -m ballast.node`:
# the cache warm-up from storage, checkpoint sync, the torchrun launcher). No Airflow: `ballast.node`
# imports none of it (tests/test_dags.py checks the parse-time imports; `ballast.node` is pydantic,
# boto3, pyarrow and torch).
# Build from the repository root:  docker build -f docker/training.Dockerfile -t ballast-training .
# CUDA PyTorch: PyPI's Linux x86_64 wheel of torch 2.13.0 is the CUDA build and brings its CUDA and NCCL
# libraries as wheels (nvidia-*); the node's driver comes in through the NVIDIA container toolkit (the
# variables below; on Kubernetes the device plugin's GPU resource). For a CPU-only image (CI, tests):
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -f docker/training.Dockerfile .
FROM python:3.11-slim-bookworm

ARG TORCH_INDEX=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /opt/ballast
COPY constraints.txt pyproject.toml README.md ./
RUN pip install --extra-index-url "$TORCH_INDEX" -c constraints.txt \
        "torch==2.13.0" numpy pyarrow tfrecord pydantic pyyaml boto3 prometheus-client nvidia-ml-py
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
