"""The Kubernetes objects of one try, as pure functions of the spec and the try's `Launch`.

One node: a pod, built by the cncf-kubernetes provider's own pod builder
(`KubernetesPodOperator.build_pod_request_obj`, with no cluster: `dry_run`). Several nodes: an Indexed
Job (completions = parallelism = nodes) whose pod template is that same pod, plus a headless Service so
that node 0 is `<job>-0.<service>` for the c10d rendezvous; each pod's node rank is its completion
index, read from the `batch.kubernetes.io/job-completion-index` annotation through the downward API.

Why not Kubeflow's PyTorchJob: training-operator v1 is deprecated (Kubeflow Trainer v2 replaced it), and
an Indexed Job with a headless Service is what both JobSet and Trainer v2 build on: a cluster that runs
JobSet or Trainer wraps `indexed_job(...)`'s pod template in its own object (a ReplicatedJob of a
JobSet; a TrainJob's runtime) with no change to the pod, the command or the rendezvous.

Nothing here talks to a cluster; `ballast.launch.kubernetes` creates, watches and deletes them.
"""

from __future__ import annotations

import hashlib
import math
from types import SimpleNamespace
from typing import Any

from ballast.launch import NODE_RANK_ENV, RDZV_ENV, RDZV_PORT, Launch
from ballast.errors import ConfigError
from ballast.spec import Spec
from ballast.spec.execution import KubernetesSpec, PoolSpec

CONTAINER = "train"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
TRY_LABEL = "ballast.dev/try"
RUN_LABEL = "ballast.dev/run"
MANAGED_BY = "app.kubernetes.io/managed-by"
HOSTNAME_LABEL = "kubernetes.io/hostname"
UID = 50000  # the training image's user (docker/training.Dockerfile)
CACHE_MOUNT, WORK_MOUNT = "/cache", "/work"
FINISHED_TTL_SECONDS = 3600
"""A finished Job is deleted by the cluster after this long, should no task be left to delete it."""
KEPT_TTL_SECONDS = 7 * 86400
"""The same with keep_failed_pods: a week to inspect a failed try."""


def run_label(dag_id: str, run_id: str) -> str:
    return hashlib.sha256(f"{dag_id}/{run_id}".encode()).hexdigest()[:16]


def grace_seconds(spec: Spec) -> int:
    """The pods' terminationGracePeriodSeconds: the preemption notice (recovery.preempt_grace_seconds)."""
    return math.ceil(spec.recovery.preempt_grace_seconds)


def deadline_seconds(spec: Spec) -> int:
    """activeDeadlineSeconds of a try's Job and pods: its time limit, after which the cluster ends it
    (SIGTERM, the grace period, then the end) even when no train task is left to: the Slurm time limit's
    counterpart. A Job's counts from its creation, pending time included."""
    return _k8s(spec).time_limit_minutes * 60


def _k8s(spec: Spec) -> KubernetesSpec:
    k = spec.execution.kubernetes
    if k is None:
        raise ConfigError("execution.kubernetes: the kubernetes backend needs this section (at least image)")
    return k


def pool_for(k: KubernetesSpec, capacity: str) -> tuple[str | None, PoolSpec]:
    """The pool a try with this capacity uses: on-demand once recovery asks for it (when the spec names
    such a pool), else the default pool; (None, no constraints) when the spec names no pools."""
    if not k.pools:
        return None, PoolSpec()
    name = "on-demand" if capacity == "on-demand" and "on-demand" in k.pools else k.default_pool
    return name, k.pools[name]


def _labels(spec: Spec, launch: Launch) -> dict[str, str]:
    labels = {TRY_LABEL: str(launch.try_number), MANAGED_BY: "ballast",
              RUN_LABEL: run_label(launch.labels.get("dag_id", spec.dag_id), launch.labels.get("run_id", ""))}
    return labels


def _context(spec: Spec, launch: Launch) -> dict[str, Any]:
    """What the provider's builder reads of a task's context: the task instance's identity, for its
    pod labels (dag_id, task_id, run_id and try_number)."""
    ti = SimpleNamespace(dag_id=launch.labels.get("dag_id", spec.dag_id), task_id=launch.labels.get("task_id", "train"),
                         map_index=-1, try_number=launch.try_number)
    return {"ti": ti, "run_id": launch.labels.get("run_id", "manual"), "dag": SimpleNamespace()}


def _affinity(launch: Launch, name: str, *, nodes: int):
    from kubernetes.client import models as k8s

    node_affinity = pod_anti = None
    if launch.avoid_hosts:
        node_affinity = k8s.V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=k8s.V1NodeSelector(node_selector_terms=[
                k8s.V1NodeSelectorTerm(match_expressions=[k8s.V1NodeSelectorRequirement(
                    key=HOSTNAME_LABEL, operator="NotIn", values=sorted(launch.avoid_hosts))])]))
    if nodes > 1:  # one pod per node: two ranks' pods on one host would share its GPUs and network
        pod_anti = k8s.V1PodAntiAffinity(required_during_scheduling_ignored_during_execution=[
            k8s.V1PodAffinityTerm(topology_key=HOSTNAME_LABEL, label_selector=k8s.V1LabelSelector(
                match_labels={"batch.kubernetes.io/job-name": name}))])
    if node_affinity is None and pod_anti is None:
        return None
    return k8s.V1Affinity(node_affinity=node_affinity, pod_anti_affinity=pod_anti)


def _volumes(k: KubernetesSpec, launch: Launch):
    from kubernetes.client import models as k8s

    cache = (k8s.V1Volume(name="cache", host_path=k8s.V1HostPathVolumeSource(path=k.cache.host_path,
                                                                             type="DirectoryOrCreate"))
             if k.cache.host_path else
             k8s.V1Volume(name="cache", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=k.cache.size)))
    volumes = [
        k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=k.shm_size)),
        cache,
        k8s.V1Volume(name="work", empty_dir=k8s.V1EmptyDirVolumeSource()),
        k8s.V1Volume(name="tmp", empty_dir=k8s.V1EmptyDirVolumeSource()),
    ]
    mounts = [k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
              k8s.V1VolumeMount(name="cache", mount_path=CACHE_MOUNT),
              k8s.V1VolumeMount(name="work", mount_path=WORK_MOUNT),
              k8s.V1VolumeMount(name="tmp", mount_path="/tmp")]
    if k.storage_claim:
        if not launch.shared_path:
            raise ConfigError("execution.kubernetes.storage_claim: the try has no storage path to mount it at")
        volumes.append(k8s.V1Volume(name="storage", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
            claim_name=k.storage_claim)))
        mounts.append(k8s.V1VolumeMount(name="storage", mount_path=launch.shared_path))
    return volumes, mounts


def _env(spec: Spec, launch: Launch, name: str, *, nodes: int):
    from kubernetes.client import models as k8s

    k = _k8s(spec)
    env = {**spec.execution.env, **launch.env, "BALLAST_CACHE_DIR": CACHE_MOUNT, "BALLAST_WORK_DIR": WORK_MOUNT,
           "HOME": "/tmp"}
    out = [k8s.V1EnvVar(name=key, value=value) for key, value in sorted(env.items())]
    if nodes > 1:
        service = f"{name}.{k.namespace}.svc"
        out += [
            k8s.V1EnvVar(name=NODE_RANK_ENV, value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(
                field_path=f"metadata.annotations['{COMPLETION_INDEX}']"))),
            k8s.V1EnvVar(name=RDZV_ENV, value=f"{name}-0.{service}:{RDZV_PORT}"),
        ]
    else:
        out.append(k8s.V1EnvVar(name=NODE_RANK_ENV, value="0"))
    out.append(k8s.V1EnvVar(name="BALLAST_NODE_NAME", value_from=k8s.V1EnvVarSource(
        field_ref=k8s.V1ObjectFieldSelector(field_path="spec.nodeName"))))
    return out


def pod(spec: Spec, launch: Launch, *, nodes: int = 1):
    """The training pod of one node (the pod template of the Job when `nodes` > 1), built by the
    provider's `KubernetesPodOperator`."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from kubernetes.client import models as k8s

    k = _k8s(spec)
    name = launch.name
    _, pool = pool_for(k, launch.capacity)
    gpu = {k.gpu_resource: str(k.gpus_per_node)} if k.gpus_per_node and k.gpu_resource else {}
    resources = k8s.V1ResourceRequirements(requests={"cpu": k.cpu, "memory": k.memory, **gpu},
                                           limits={"cpu": k.cpu, "memory": k.memory, **gpu})
    volumes, mounts = _volumes(k, launch)
    tolerations = [k8s.V1Toleration(key=t.key, operator=t.operator, value=t.value, effect=t.effect)
                   for t in pool.tolerations] or None
    op = KubernetesPodOperator(
        task_id=launch.labels.get("task_id", "train"), name=name, random_name_suffix=False, namespace=k.namespace,
        image=k.image, image_pull_policy=k.image_pull_policy, base_container_name=CONTAINER,
        cmds=list(launch.command[:1]), arguments=list(launch.command[1:]),
        labels=_labels(spec, launch), container_resources=resources,
        node_selector=dict(pool.node_selector) or None, tolerations=tolerations,
        affinity=_affinity(launch, name, nodes=nodes),
        priority_class_name=pool.priority_class or k.priority_class,
        service_account_name=k.service_account, automount_service_account_token=k.service_account is not None,
        volumes=volumes, volume_mounts=mounts, env_vars=_env(spec, launch, name, nodes=nodes),
        env_from=[k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=k.storage_secret))]
        if k.storage_secret else None,
        ports=[k8s.V1ContainerPort(name="c10d", container_port=RDZV_PORT)] if nodes > 1 else None,
        security_context=k8s.V1PodSecurityContext(run_as_non_root=True, run_as_user=UID, run_as_group=UID,
                                                  fs_group=UID,
                                                  seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault")),
        container_security_context=k8s.V1SecurityContext(
            run_as_non_root=True, allow_privilege_escalation=False, read_only_root_filesystem=True,
            privileged=False, capabilities=k8s.V1Capabilities(drop=["ALL"]),
            seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault")),
        termination_grace_period=grace_seconds(spec), active_deadline_seconds=deadline_seconds(spec),
        subdomain=name if nodes > 1 else None,
        on_finish_action="delete_succeeded_pod" if k.keep_failed_pods else "delete_pod",
        do_xcom_push=False, get_logs=True,
    )
    built = op.build_pod_request_obj(_context(spec, launch), dry_run=True)
    built.metadata.labels.pop("airflow_version", None)  # the worker's version is no property of the pod
    return built


def indexed_job(spec: Spec, launch: Launch):
    """An Indexed Job of `launch.nodes` pods: completions = parallelism = nodes; a disruption (a
    preemption, a drain, a node's graceful shutdown) is ignored by the Job's backoff count, so the Job
    controller replaces the pod and the elastic agents re-form the group; an exit code of a class that
    a new try must adapt to (or no retry can fix) fails the Job at once."""
    from kubernetes.client import models as k8s

    from ballast.training.failure import EXIT_CODES

    from ballast.training.torchrun import RESTART_IN_TRY

    template = pod(spec, launch, nodes=launch.nodes)
    # torchrun exits with a class's code when that class needs a new try (or none): the Job fails at once
    # and the orchestrator's next try adapts, instead of the Job rerunning the same pod (its backoff
    # limit, recovery.max_restarts, is for pods that crashed: a rank killed outright, a broken link)
    fatal = sorted(code for cls, code in EXIT_CODES.items() if cls not in RESTART_IN_TRY)
    rules = [k8s.V1PodFailurePolicyRule(action="Ignore", on_pod_conditions=[
        k8s.V1PodFailurePolicyOnPodConditionsPattern(type="DisruptionTarget", status="True")])]
    if fatal:
        rules.append(k8s.V1PodFailurePolicyRule(action="FailJob", on_exit_codes=k8s.V1PodFailurePolicyOnExitCodesRequirement(
            container_name=CONTAINER, operator="In", values=fatal)))
    meta = template.metadata
    return k8s.V1Job(
        api_version="batch/v1", kind="Job",
        metadata=k8s.V1ObjectMeta(name=launch.name, namespace=meta.namespace, labels=dict(meta.labels)),
        spec=k8s.V1JobSpec(
            completion_mode="Indexed", completions=launch.nodes, parallelism=launch.nodes,
            backoff_limit=spec.recovery.max_restarts, pod_failure_policy=k8s.V1PodFailurePolicy(rules=rules),
            active_deadline_seconds=deadline_seconds(spec),
            ttl_seconds_after_finished=KEPT_TTL_SECONDS if _k8s(spec).keep_failed_pods else FINISHED_TTL_SECONDS,
            template=k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=dict(meta.labels)), spec=template.spec)))


def headless_service(spec: Spec, launch: Launch):
    """The rendezvous names of an Indexed Job's pods (`<job>-<index>.<service>`), ready or not."""
    from kubernetes.client import models as k8s

    k = _k8s(spec)
    return k8s.V1Service(
        api_version="v1", kind="Service",
        metadata=k8s.V1ObjectMeta(name=launch.name, namespace=k.namespace, labels=_labels(spec, launch)),
        spec=k8s.V1ServiceSpec(cluster_ip="None", publish_not_ready_addresses=True,
                               selector={"batch.kubernetes.io/job-name": launch.name},
                               ports=[k8s.V1ServicePort(name="c10d", port=RDZV_PORT, target_port=RDZV_PORT)]))


def objects(spec: Spec, launch: Launch) -> list[Any]:
    """Everything one try creates: a pod (one node), or a headless Service and an Indexed Job."""
    if launch.nodes == 1:
        return [pod(spec, launch)]
    return [headless_service(spec, launch), indexed_job(spec, launch)]


def as_dicts(objs: list[Any]) -> list[dict]:
    """The objects as the API server reads them (camelCase, no nulls)."""
    from kubernetes.client import ApiClient

    return [ApiClient().sanitize_for_serialization(o) for o in objs]
