# The training image: only what runs inside a training process (training/), no Airflow.
# Its contract: a run config JSON in; checkpoints, metrics, failure.json and an exit code out.
# Build from the repository root:  docker build -f docker/training.Dockerfile -t ballast-training .
# For GPUs, base it on an NVIDIA CUDA runtime image and install the matching CUDA build of torch 2.13.0.
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /opt/ballast
COPY constraints.txt ./
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt \
        "torch==2.13.0" numpy pyarrow tfrecord
COPY training/ training/
RUN useradd --create-home --uid 50000 trainer
USER trainer
# torchrun arguments (--nnodes, --nproc-per-node, --rdzv-*) come from ballast.launch.torchrun_argv.
ENTRYPOINT ["python", "-m", "torch.distributed.run"]
CMD ["--standalone", "--nproc-per-node=1", "--module", "training", "--help"]
