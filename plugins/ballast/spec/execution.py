"""The spec's `execution` section: where training runs.

    execution:
      backend: kubernetes              # local (torchrun on the Airflow worker), kubernetes or slurm
      kubernetes:
        image: registry.example.com/ballast-training:1.0
        gpus_per_node: 8
        gpu_resource: nvidia.com/gpu
        pools:
          spot: {node_selector: {pool: spot}, tolerations: [{key: spot, operator: Exists}]}
          on-demand: {node_selector: {pool: on-demand}}

The same spec runs on every backend; only this section changes. Every name and value here reaches a
manifest or a batch script, so each is checked against what the platform accepts: a value that could
carry shell syntax into a batch script is refused here, before it is quoted there.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ballast.training.config.sections import ExecutionSettings, Section

Pool = Literal["spot", "on-demand"]
"""Capacity pools a backend can be asked for: `spot` (preemptible) and `on-demand`."""

DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
QUANTITY = r"[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?"
LABEL_KEY = r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
SLURM_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}"
"""Partition, QoS and account names: what Slurm's own names use, and nothing a shell would read."""

DEFAULT_ENV = {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def _match(pattern: str, value: str, what: str) -> str:
    if not re.fullmatch(pattern, value):
        raise ValueError(f"{value!r} is not a valid {what}")
    return value


class TolerationSpec(Section):
    key: str | None = None
    """Taint key to tolerate (none with operator Exists: every taint)."""
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None

    @model_validator(mode="after")
    def _check(self) -> TolerationSpec:
        if self.key is not None:
            _match(LABEL_KEY, self.key, "taint key")
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("value: a toleration with operator Exists takes no value")
        if self.operator == "Equal" and self.key is None:
            raise ValueError("key: a toleration with operator Equal needs a key")
        return self


class PoolSpec(Section):
    node_selector: dict[str, str] = {}
    """Node labels a training pod of this pool must match."""
    tolerations: tuple[TolerationSpec, ...] = ()
    """Taints of this pool's nodes the pods tolerate."""
    priority_class: str | None = None
    """Priority class of this pool's pods (default: kubernetes.priority_class)."""

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            _match(LABEL_KEY, key, "label key")
            _match(LABEL_VALUE, value, f"label value (of {key})")
        return v


class CacheVolumeSpec(Section):
    size: str = "50Gi"
    """Size of the node-local cache volume (an emptyDir's sizeLimit, or the host path's expected size)."""
    host_path: str | None = None
    """A directory on the node (its local NVMe) instead of an emptyDir: survives the pod, warm for the next try."""

    @field_validator("size")
    @classmethod
    def _size(cls, v: str) -> str:
        return _match(QUANTITY, v, "Kubernetes quantity (e.g. 200Gi)")

    @field_validator("host_path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or ".." in v.split("/")):
            raise ValueError(f"{v!r}: give an absolute path on the node, without '..'")
        return v


class KubernetesSpec(Section):
    image: str = Field(min_length=1)
    """Training image (built from docker/training.Dockerfile)."""
    conn_id: str = "kubernetes_default"
    """Airflow connection of the cluster (kubernetes type: in-cluster, a kube config, a context)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    namespace: str = "default"
    """Namespace of the training pods."""
    service_account: str | None = None
    """Service account of the training pods (its credentials reach the storage)."""
    cpu: str = "2"
    """CPU request and limit per pod (one pod per node)."""
    memory: str = "8Gi"
    """Memory request and limit per pod."""
    gpus_per_node: int = Field(0, ge=0, le=16)
    """GPUs per pod (its limit of gpu_resource)."""
    gpu_resource: str | None = None
    """The extended resource that counts GPUs on this cluster (nvidia.com/gpu, amd.com/gpu)."""
    shm_size: str = "2Gi"
    """Size of the memory-backed /dev/shm (data loader workers and NCCL use it)."""
    cache: CacheVolumeSpec = CacheVolumeSpec()
    """The node-local cache volume each pod warms from storage."""
    pools: dict[Pool, PoolSpec] = {}
    """Node selectors and tolerations per capacity pool; none: the scheduler's choice."""
    default_pool: Pool = "spot"
    """The pool a try uses until recovery asks for on-demand (when pools names it)."""
    priority_class: str | None = None
    """Priority class of the training pods."""
    storage_secret: str | None = None
    """A Secret whose keys become the pods' environment (AWS_ACCESS_KEY_ID, ...): the storage credentials."""
    storage_claim: str | None = None
    """With storage.uri a path: a ReadWriteMany PersistentVolumeClaim holding it, mounted in every pod at
    the path the workers see it at (a shared file system, as a Slurm cluster's)."""
    keep_failed_pods: bool = False
    """Keep a failed try's pods and Job for inspection (deleted otherwise, like a finished one's)."""
    time_limit_minutes: int = Field(1440, ge=1, le=525_600)
    """A try's time limit (its Job's and pods' activeDeadlineSeconds): the cluster ends the try then, even
    when no train task is left to (SIGTERM, then the pods' grace period: the trainer commits a checkpoint
    and the next try resumes, as after a preemption)."""

    @field_validator("namespace", "service_account", "priority_class")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return v if v is None else _match(DNS_LABEL if len(v) <= 63 else DNS_SUBDOMAIN, v, "Kubernetes name")

    @field_validator("storage_secret", "storage_claim")
    @classmethod
    def _secret(cls, v: str | None) -> str | None:
        return v if v is None else _match(DNS_SUBDOMAIN, v, "Secret name")

    @field_validator("cpu", "memory", "shm_size")
    @classmethod
    def _quantities(cls, v: str) -> str:
        return _match(QUANTITY, v, "Kubernetes quantity (e.g. 4, 500m, 16Gi)")

    @field_validator("gpu_resource")
    @classmethod
    def _resource(cls, v: str | None) -> str | None:
        return v if v is None else _match(LABEL_KEY, v, "extended resource name (e.g. nvidia.com/gpu)")

    @model_validator(mode="after")
    def _check(self) -> KubernetesSpec:
        if self.gpus_per_node and not self.gpu_resource:
            raise ValueError(f"gpu_resource: gpus_per_node is {self.gpus_per_node} but no GPU resource is named;"
                             f" set gpu_resource (nvidia.com/gpu on NVIDIA's device plugin)")
        if self.pools and self.default_pool not in self.pools:
            raise ValueError(f"default_pool: {self.default_pool!r} is not among pools ({', '.join(self.pools)})")
        return self


class SlurmSpec(Section):
    partition: str
    """Partition of the default (preemptible) tries."""
    on_demand_partition: str | None = None
    """Partition once recovery asks for on-demand capacity (default: partition, with on_demand_qos)."""
    qos: str | None = None
    """QoS of the default tries (a preemptible QoS on clusters that preempt by QoS)."""
    on_demand_qos: str | None = None
    """QoS once recovery asks for on-demand capacity."""
    account: str | None = None
    """Account charged for the job."""
    time_limit_minutes: int = Field(1440, ge=1, le=525_600)
    """The job's time limit; the preemption notice (SIGTERM) comes recovery.preempt_grace_seconds before it."""
    cpus_per_node: int = Field(2, ge=1, le=1024)
    """CPUs of the one task per node (its launcher and its ranks)."""
    memory: str = "8G"
    """Memory per node (sbatch --mem)."""
    gpus_per_node: int = Field(0, ge=0, le=16)
    """GPUs per node (sbatch --gpus-per-node)."""
    python: str = "python3"
    """The Python on the nodes that has Ballast installed (a path or a name on PATH)."""
    poll_seconds: float = Field(2.0, gt=0, le=300)
    """How often the job's state is read while it runs."""

    @field_validator("partition", "on_demand_partition", "qos", "on_demand_qos", "account")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return v if v is None else _match(SLURM_NAME, v, "Slurm name (letters, digits, '_', '.', '-')")

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str) -> str:
        return _match(r"[0-9]+[KMGT]?", v, "Slurm memory size (e.g. 64G)")

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        return _match(r"[A-Za-z0-9_./+\-]+", v, "interpreter path (no spaces or shell characters)")


class ExecutionSpec(ExecutionSettings):
    backend: Literal["local", "kubernetes", "slurm"] = "local"
    """Where training runs: `local` (torchrun on the worker), `kubernetes` (one pod per node) or
    `slurm` (one job of training.nodes nodes)."""
    kubernetes: KubernetesSpec | None = None
    """Pod settings; required when backend is kubernetes."""
    slurm: SlurmSpec | None = None
    """Job settings; required when backend is slurm."""
    env: dict[str, str] = DEFAULT_ENV
    """Environment of the training processes on a cluster backend (NCCL settings, ...)."""

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            _match(ENV_NAME, name, "environment variable name")
        return v

    @model_validator(mode="after")
    def _check_backend(self) -> ExecutionSpec:
        for backend in ("kubernetes", "slurm"):
            if self.backend == backend and getattr(self, backend) is None:
                hint = "image" if backend == "kubernetes" else "partition"
                raise ValueError(f"{backend}: backend {backend!r} needs a {backend} section with at least {hint}")
        return self

    @property
    def gpus_per_node(self) -> int:
        section = {"kubernetes": self.kubernetes, "slurm": self.slurm}.get(self.backend)
        return section.gpus_per_node if section is not None else 0
