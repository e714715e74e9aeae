"""The Kubernetes backend offline: manifests built by the provider's own pod builder, serialised by the
kubernetes client and validated strictly against Kubernetes' schemas (kubernetes-validate), plus what
schema validation misses; failure reasons read from pod statuses shaped as clusters report them.

No cluster runs here: nothing in this file talks to an API server.
"""

from __future__ import annotations

import time

import kubernetes_validate
import pytest
import yaml
from ballast.launch import launch_for
from ballast.launch.kubernetes import manifests as k8s_manifests, status as k8s_status
from ballast.launch.preview import earlier_tries
from ballast.recovery import adapt
from ballast.errors import SpecError
from ballast.spec import parse_spec
from helpers import example_data, write_spec
from kubernetes.client import models as k8s

K8S_VERSION = "1.33"
POOLS = {
    "spot": {"node_selector": {"cloud.example.com/capacity": "spot"},
             "tolerations": [{"key": "cloud.example.com/spot", "operator": "Exists", "effect": "NoSchedule"}],
             "priority_class": "training-preemptible"},
    "on-demand": {"node_selector": {"cloud.example.com/capacity": "on-demand"}},
}


def k8s_spec(nodes: int = 1, s3: bool = False, **kube):
    """Several nodes share a file system (a ReadWriteMany claim holding storage); one node may use S3."""
    data = example_data()
    data["training"].update(nodes=nodes, global_batch_size=64 * nodes)
    section = {"image": "registry.example.com/ballast-training:1.0", "gpus_per_node": 2,
               "gpu_resource": "nvidia.com/gpu", "cpu": "16", "memory": "120Gi", "shm_size": "16Gi",
               "cache": {"size": "200Gi"}, "pools": POOLS, "service_account": "trainer",
               "storage_secret": "ballast-s3", "namespace": "ml", **kube}
    if s3:
        data["storage"] = {"uri": "s3://ballast-bucket/pipelines"}
    else:
        section.setdefault("storage_claim", "ballast-storage")
    data["execution"] = {"backend": "kubernetes", "kubernetes": section}
    data["recovery"] = {"preempt_grace_seconds": 90}
    return parse_spec(data)


SHARED = "/mnt/ballast/storage"


def launch(spec, try_number=1, after=()):
    settings, _ = adapt.next_settings(spec, earlier_tries(list(after)))
    s3 = spec.storage.uri.startswith("s3://")
    return launch_for(spec, settings, dag_id=spec.dag_id, run_id="manual__2026-12-03", task_id="train",
                      try_number=try_number, job_ref="s3://ballast-bucket/pipelines/runs/x/train/try-1/job.json"
                      if s3 else f"{SHARED}/runs/x/train/try-1/job.json", shared_path=None if s3 else SHARED)


def docs(spec, lau):
    return k8s_manifests.as_dicts(k8s_manifests.objects(spec, lau))


def validate(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on an unknown field or a bad type


def pod_spec(doc):
    return doc["spec"]["template"]["spec"] if doc["kind"] == "Job" else doc["spec"]


def check_training_pod(spec, ps):
    """What every training pod carries, one node or many."""
    (c,) = ps["containers"]
    assert c["name"] == "train" and c["image"] == "registry.example.com/ballast-training:1.0"
    assert c["command"] == ["python"] and c["args"][:3] == ["-m", "ballast.node", "--job"]  # a list, no shell
    want = {"cpu": "16", "memory": "120Gi", "nvidia.com/gpu": "2"}
    assert c["resources"]["requests"] == want and c["resources"]["limits"] == want
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert ps["securityContext"]["runAsNonRoot"] and ps["securityContext"]["runAsUser"] != 0
    assert ps["restartPolicy"] == "Never"
    assert ps["terminationGracePeriodSeconds"] == 90  # recovery.preempt_grace_seconds
    assert ps["serviceAccountName"] == "trainer"
    volumes = {v["name"]: v for v in ps["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["cache"]["emptyDir"] == {"sizeLimit": "200Gi"}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm" and mounts["/cache"] == "cache" and mounts["/tmp"] == "tmp"
    assert set(mounts.values()) <= set(volumes)  # every mount has its volume
    env = {e["name"]: e for e in c["env"]}
    assert env["NCCL_DEBUG"]["value"] == "WARN" and env["BALLAST_CACHE_DIR"]["value"] == "/cache"
    assert c["envFrom"] == [{"secretRef": {"name": "ballast-s3"}}]
    return c, env


@pytest.mark.unit
def test_a_one_node_manifest_is_a_pod_that_validates_strictly_and_carries_the_spec():
    spec = k8s_spec(nodes=1, s3=True)
    (doc,) = docs(spec, launch(spec))
    validate(doc)
    assert doc["kind"] == "Pod" and doc["metadata"]["namespace"] == "ml"
    labels = doc["metadata"]["labels"]
    assert labels["ballast.dev/try"] == "1" and labels["try_number"] == "1"  # the provider's labels, and ours
    assert labels["dag_id"] == spec.dag_id and labels["task_id"] == "train"
    _, env = check_training_pod(spec, doc["spec"])
    assert env["BALLAST_NODE_RANK"]["value"] == "0" and "BALLAST_RDZV_ENDPOINT" not in env
    ps = doc["spec"]
    assert ps["nodeSelector"] == {"cloud.example.com/capacity": "spot"}  # the default pool
    assert ps["tolerations"] == [{"key": "cloud.example.com/spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert ps["priorityClassName"] == "training-preemptible"
    assert not ps.get("affinity")  # no avoid list, one node
    assert "storage" not in {v["name"] for v in ps["volumes"]}  # S3: nothing shared to mount


@pytest.mark.unit
def test_a_four_node_manifest_is_an_indexed_job_with_a_headless_service():
    spec = k8s_spec(nodes=4)
    service, job = docs(spec, launch(spec))
    for doc in (service, job):
        validate(doc)
    name = job["metadata"]["name"]
    js = job["spec"]
    assert js["completionMode"] == "Indexed" and js["completions"] == js["parallelism"] == 4
    assert js["backoffLimit"] == spec.recovery.max_restarts
    rules = js["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    fail = rules[1]
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["containerName"] == "train"
    # every class torchrun ends the launch with (all but communication, which a group restart fixes): the
    # next try adapts (oom 73, divergence 71, hardware 74, ...) or none comes (config, data, user_code)
    assert set(fail["onExitCodes"]["values"]) == {64, 65, 70, 71, 73, 74, 75, 76}
    # Cross-field rules no schema checks: the pods' DNS names are the Service's, node 0 is the rendezvous.
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    ps = js["template"]["spec"]
    assert ps["subdomain"] == service["metadata"]["name"] == name
    assert len(f"{name}-{js['completions'] - 1}") <= 63  # pod hostnames are DNS labels
    c, env = check_training_pod(spec, ps)
    assert env["BALLAST_RDZV_ENDPOINT"]["value"] == f"{name}-0.{name}.ml.svc:29400"
    assert env["BALLAST_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert {"name": "c10d", "containerPort": 29400} in c["ports"]
    volumes = {v["name"]: v for v in ps["volumes"]}
    assert volumes["storage"]["persistentVolumeClaim"] == {"claimName": "ballast-storage"}
    assert {"name": "storage", "mountPath": SHARED} in c["volumeMounts"]  # where the workers see storage
    anti = ps["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"  # one pod per node
    assert job["metadata"]["labels"]["ballast.dev/try"] == js["template"]["metadata"]["labels"]["ballast.dev/try"]


@pytest.mark.unit
def test_try_two_after_preemptions_moves_to_the_on_demand_pool():
    spec = k8s_spec(nodes=4)
    first = docs(spec, launch(spec, 1))[1]
    after = docs(spec, launch(spec, 3, after=["preempted", "preempted"]))[1]  # on_demand_after_preemptions: 2
    validate(after)
    before_ps, after_ps = pod_spec(first), pod_spec(after)
    assert before_ps["nodeSelector"] == {"cloud.example.com/capacity": "spot"}
    assert after_ps["nodeSelector"] == {"cloud.example.com/capacity": "on-demand"}
    assert "tolerations" not in after_ps or not after_ps["tolerations"]  # no spot toleration on on-demand
    assert after["metadata"]["name"].endswith("-t3") and after["metadata"]["labels"]["ballast.dev/try"] == "3"
    one = docs(spec, launch(spec, 2, after=["preempted"]))[1]  # one preemption: still spot
    assert pod_spec(one)["nodeSelector"] == {"cloud.example.com/capacity": "spot"}


@pytest.mark.unit
def test_try_two_after_a_hang_avoids_the_host_and_after_an_oom_has_the_smaller_micro_batch():
    spec = k8s_spec(nodes=4)
    job = docs(spec, launch(spec, 2, after=["hang@gpu-node-17"]))[1]
    validate(job)
    terms = pod_spec(job)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-node-17"]}]}]
    oom = docs(spec, launch(spec, 2, after=["oom"]))[1]
    env = {e["name"]: e.get("value") for e in pod_spec(oom)["containers"][0]["env"]}
    assert not [name for name in env if "BATCH" in name]  # a setting travels once: in the run config


@pytest.mark.unit
def test_the_smaller_micro_batch_after_an_oom_reaches_the_node_in_the_run_config_alone(tmp_path, monkeypatch):
    from ballast.launch.config import run_config
    from ballast.node import NodeJob, node_config

    spec = k8s_spec(nodes=4)
    settings, _ = adapt.next_settings(spec, earlier_tries(["oom"]))
    cfg = run_config(spec, data_dir="/worker/cache", data_format="petastorm", checkpoint_dir="/worker/ckpt",
                     output_dir="/worker/out", micro_batch_size=settings.micro_batch_size)
    job = NodeJob.model_validate_json(NodeJob(
        spec=spec.model_dump(mode="json"), dag_id=spec.dag_id, run_id="r", task_id="train", try_number=2,
        name="t", run_config=cfg.model_dump(mode="json"), out_dir="/worker/out",
        checkpoint_dir="/worker/ckpt").model_dump_json())  # as the node reads it from storage
    monkeypatch.setenv("BALLAST_MICRO_BATCH_SIZE", str(spec.training.micro_batch_size))  # no longer read
    node = node_config(job, out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", data_dir="/node/cache",
                       data_format="tfrecord")
    assert node.batch.micro_batch_size == settings.micro_batch_size < spec.training.micro_batch_size
    assert node.batch.grad_accum_steps == spec.training.grad_accum_for(settings.micro_batch_size) > 1
    assert node.model_dump(exclude={"output_dir", "data", "checkpoint"}) \
        == cfg.model_dump(exclude={"output_dir", "data", "checkpoint"})  # every other setting as written
    assert (node.output_dir, node.data.directory, node.data.format, node.checkpoint.directory) \
        == (str(tmp_path / "out"), "/node/cache", "tfrecord", str(tmp_path / "ckpt"))


@pytest.mark.unit
def test_render_prints_the_manifests_as_yaml(tmp_path, capsys):
    from ballast.dev.cli import main

    data = example_data()
    data["execution"] = {"backend": "kubernetes", "kubernetes": {"image": "ballast-training:1", "pools": POOLS,
                                                                 "storage_claim": "ballast-storage"}}
    path = write_spec(tmp_path / "k.yaml", data=data)
    assert main(["render", str(path), "--try", "3", "--after", "preempted", "preempted"]) == 0
    (pod,) = list(yaml.safe_load_all(capsys.readouterr().out))
    validate(pod)
    assert pod["spec"]["nodeSelector"] == {"cloud.example.com/capacity": "on-demand"}
    assert pod["metadata"]["labels"]["ballast.dev/try"] == "3"


BAD = [
    ("no image", {"image": ""}, r"execution\.kubernetes\.image"),
    ("no section", None, r"execution\.kubernetes: backend 'kubernetes' needs a kubernetes section with at least image"),
    ("gpus without a resource", {"gpu_resource": None},
     r"execution\.kubernetes\.gpu_resource: gpus_per_node is 2 but no GPU resource is named"),
    ("unknown pool", {"pools": {"spot": {}, "reserved": {}}}, r"execution\.kubernetes\.pools\.reserved"),
    ("default pool missing", {"pools": {"on-demand": {}}}, r"execution\.kubernetes\.default_pool: 'spot' is not among"),
    ("bad quantity", {"memory": "lots"}, r"execution\.kubernetes\.memory: 'lots' is not a valid Kubernetes quantity"),
    ("bad namespace", {"namespace": "ML_Team"}, r"execution\.kubernetes\.namespace"),
    ("a path pods cannot see", {"storage_claim": None},
     r"execution\.kubernetes\.storage_claim: storage\.uri is a path \('storage'\) that training pods cannot see"),
    ("gpus and processes differ", {"gpus_per_node": 4},
     r"training\.processes_per_node: 2 processes per node but execution\.kubernetes\.gpus_per_node is 4"),
]


@pytest.mark.unit
@pytest.mark.parametrize("what,section,message", BAD, ids=[b[0] for b in BAD])
def test_bad_kubernetes_sections_are_refused_with_one_line_naming_the_field(what, section, message):
    from ballast.errors import SpecError

    data = example_data()
    base = {"image": "ballast-training:1", "gpus_per_node": 2, "gpu_resource": "nvidia.com/gpu",
            "storage_claim": "ballast-storage"}
    data["execution"] = {"backend": "kubernetes"}
    if section is not None:
        data["execution"]["kubernetes"] = {**base, **section}
    with pytest.raises(SpecError, match=message) as err:
        parse_spec(data)
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_a_node_count_beyond_what_the_job_expresses_is_refused():
    from ballast.errors import SpecError

    data = example_data()
    data["training"].update(nodes=5000)
    data["execution"] = {"backend": "kubernetes", "kubernetes": {"image": "ballast-training:1",
                                                                 "storage_claim": "ballast-storage"}}
    with pytest.raises(SpecError, match=r"training\.nodes"):
        parse_spec(data)


@pytest.mark.unit
def test_several_nodes_on_s3_storage_are_accepted_and_each_pod_pushes_its_own_share():
    # Each node pushes its own ranks' shards and node 0 commits once every share is in storage
    # (tests/test_multinode_s3.py), so s3:// storage no longer takes one node only.
    spec = k8s_spec(nodes=4, s3=True)
    assert spec.training.nodes == 4 and spec.storage.uri.startswith("s3://")
    service, job = docs(spec, launch(spec))
    for doc in (service, job):
        validate(doc)
    js = job["spec"]
    assert js["completionMode"] == "Indexed" and js["completions"] == js["parallelism"] == 4
    assert "storage" not in {v["name"] for v in js["template"]["spec"]["volumes"]}  # S3: nothing shared to mount


# --- failure reasons, from pod statuses as clusters report them -------------------------------------


def pod_with(phase, *, reason=None, message=None, exit_code=None, term_reason=None, conditions=(), node="gpu-3"):
    term = (k8s.V1ContainerStateTerminated(exit_code=exit_code, reason=term_reason,
                                           finished_at="2026-12-03T10:00:00Z")
            if exit_code is not None else None)
    statuses = [k8s.V1ContainerStatus(name="train", image="i", image_id="", ready=False, restart_count=0,
                                      state=k8s.V1ContainerState(terminated=term))] if term else None
    return k8s.V1Pod(spec=k8s.V1PodSpec(containers=[], node_name=node), status=k8s.V1PodStatus(
        phase=phase, reason=reason, message=message, container_statuses=statuses,
        conditions=[k8s.V1PodCondition(type=t, status="True", reason=r, message=m) for t, r, m in conditions]))


REASONS = [
    ("oomkilled", pod_with("Failed", exit_code=137, term_reason="OOMKilled"), "oom", "OOMKilled"),
    ("evicted", pod_with("Failed", reason="Evicted", message="The node was low on resource: memory."),
     "preempted", "Evicted"),
    ("preemption", pod_with("Failed", exit_code=143, term_reason="Error", conditions=[
        ("DisruptionTarget", "PreemptionByScheduler", "Kubernetes Scheduler: preempting to accommodate a higher"
                                                     " priority pod")]), "preempted", "PreemptionByScheduler"),
    ("drain", pod_with("Failed", exit_code=143, conditions=[
        ("DisruptionTarget", "EvictionByEvictionAPI", "Eviction API: evicting")]), "preempted", "EvictionByEvictionAPI"),
    ("node shutdown", pod_with("Failed", exit_code=143, conditions=[
        ("DisruptionTarget", "TerminationByKubelet", "Pod was terminated in response to imminent node shutdown.")]),
     "preempted", "TerminationByKubelet"),
    ("taint", pod_with("Failed", conditions=[
        ("DisruptionTarget", "DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint")]),
     "hardware", "DeletionByTaintManager"),
    ("pod gc", pod_with("Failed", conditions=[
        ("DisruptionTarget", "DeletionByPodGC", "PodGC: node no longer exists")]), "lost", "DeletionByPodGC"),
    ("node lost", pod_with("Unknown", reason="NodeLost", message="Node gpu-3 which was running pod is unresponsive"),
     "lost", "NodeLost"),
    ("class exit code", pod_with("Failed", exit_code=73, term_reason="Error"), None, "Error"),
    ("deadline", pod_with("Failed", reason="DeadlineExceeded", message="Pod was active on the node longer than"
                                                                      " the specified deadline"),
     "preempted", "DeadlineExceeded"),
]


@pytest.mark.unit
@pytest.mark.parametrize("what,pod,cls,reason", REASONS, ids=[r[0] for r in REASONS])
def test_failure_reasons_are_read_from_the_pod(what, pod, cls, reason):
    end = k8s_status.ending(pod)
    assert end is not None and end.failure_class == cls and end.reason.startswith(reason)
    assert end.host == "gpu-3" and not end.ok


@pytest.mark.unit
def test_a_running_pod_has_not_ended_and_a_succeeded_one_is_ok():
    assert k8s_status.ending(pod_with("Running")) is None
    ok = k8s_status.ending(pod_with("Succeeded", exit_code=0, term_reason="Completed"))
    assert ok.ok and ok.exit_code == 0


@pytest.mark.unit
def test_of_a_jobs_pods_the_platform_reason_explains_the_failure():
    preempted = pod_with("Failed", exit_code=143, conditions=[("DisruptionTarget", "PreemptionByScheduler", "")],
                         node="gpu-1")
    peer = pod_with("Failed", exit_code=72, term_reason="Error", node="gpu-2")  # its communication error followed
    end = k8s_status.first_failure([peer, preempted])
    assert end.failure_class == "preempted" and end.host == "gpu-1"


# --- the backend's calls, against a recording stand-in for the API server ----------------------------


class FakeClock:
    """The kubernetes backend's `time`: sleeping moves the clock on at once."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeAPI:
    """Records create/list/read/delete calls; pods and the Job's conditions are set by the test. A created
    Job or pod has its pods running at once; deleted, they linger `linger` seconds of `clock` (their
    grace period: the trainers commit a checkpoint) before the API stops listing them."""

    def __init__(self, clock=None, linger: float = 0.0):
        self.calls: list[tuple[str, str]] = []
        self.timeline: list[tuple[float, str]] = []  # creates, deletes and pods gone, with the clock's time
        self.pods: list = []
        self.strays: list = []  # pods the selector would not match: another try's
        self.job_conditions: list = []
        self.delete_bodies: list = []
        self.clock, self.linger, self.deleted_at = clock, linger, None
        import threading

        self.cond = threading.Condition()
        self.containers: dict[str, list[list]] = {}  # pod -> its containers' logs (a restart adds one)
        self.node_now = __import__("time").time() - 1e6  # the lines' times: a second apart, in the past
        self.reads: list = []
        self.served: dict[str, int] = {}
        self.cut_after: dict[str, int] = {}

    def _now(self) -> float:
        return self.clock.now if self.clock is not None else 0.0

    def _event(self, what: str) -> None:
        self.timeline.append((self._now(), what))

    def create_namespaced_pod(self, ns, body):
        self.calls.append(("create", f"Pod/{body.metadata.name}"))
        self._event(f"create {body.metadata.name}")
        self.pods, self.deleted_at = [job_pod(body.metadata.labels, 0, "Running")], None

    def create_namespaced_service(self, ns, body):
        self.calls.append(("create", f"Service/{body.metadata.name}"))

    def create_namespaced_job(self, ns, body):
        self.calls.append(("create", f"Job/{body.metadata.name}"))
        self._event(f"create {body.metadata.name}")
        self.template_labels = body.spec.template.metadata.labels
        self.pods, self.deleted_at = [job_pod(self.template_labels, i, "Running")
                                      for i in range(body.spec.completions)], None

    def list_namespaced_pod(self, ns, label_selector):
        if self.pods and self.deleted_at is not None and self._now() - self.deleted_at >= self.linger:
            self.pods = []
            self._event("pods gone")
        wanted = dict(part.split("=") for part in label_selector.split(","))
        return k8s.V1PodList(items=[p for p in self.pods if all(
            (p.metadata.labels or {}).get(k) == v for k, v in wanted.items())] + self.strays)

    # -- the pods' logs, served as the API server streams them (follow=True) ------------------------------

    def append(self, name: str, *texts: str) -> None:
        """New lines in pod `name`'s running container, stamped a second apart (as if logged long ago: a
        reconnect's `since_seconds` back from now then reaches only the seconds it asks for)."""
        with self.cond:
            log = self._log(name)
            for text in texts:
                log.append((self.node_now, text))
                self.node_now += 1.0
            self.cond.notify_all()

    def restart(self, name: str) -> None:
        """The pod's container restarts in place: its stream ends, its log starts empty."""
        with self.cond:
            self._log(name)
            self.containers[name].append([])
            self.cond.notify_all()

    def _log(self, name: str) -> list:
        if name not in self.containers:
            self.containers[name] = [[(self.node_now, f"log of {name}")]]
            self.node_now += 1.0
        return self.containers[name][-1]

    def _running(self, name: str) -> bool:
        pod = next((p for p in self.pods if p.metadata.name == name), None)
        return pod is not None and self.deleted_at is None and pod.status.phase == "Running"

    def read_namespaced_pod_log(self, name, ns, container, *, follow=False, timestamps=False, since_seconds=None,
                                _preload_content=True, _request_timeout=None):
        assert container == k8s_manifests.CONTAINER and follow and timestamps and not _preload_content
        with self.cond:
            self.reads.append((name, since_seconds))
            self._log(name)
            generation = len(self.containers[name])
        return FakeStream(self, name, generation, since_seconds)


    def read_namespaced_job_status(self, name, ns):
        return k8s.V1Job(status=k8s.V1JobStatus(conditions=self.job_conditions))

    def _deleted(self, what: str, body) -> None:
        self.calls.append(("delete", what))
        self._event(f"delete {what}")
        self.delete_bodies.append(body)
        if self.deleted_at is None:
            self.deleted_at = self._now()

    def delete_namespaced_job(self, name, ns, body):
        assert body.propagation_policy == "Foreground"  # its pods go with it
        self._deleted(f"Job/{name}", body)

    def delete_namespaced_service(self, name, ns, body):
        self.calls.append(("delete", f"Service/{name}"))

    def delete_namespaced_pod(self, name, ns, body):
        self._deleted(f"Pod/{name}", body)


class FakeStream:
    """A followed log: the container's lines from `since_seconds` before the node's now, then each new one
    until the container ends (a restart, the pod ended or deleted), or `cut_after` lines (a dropped
    connection). Counts the bytes it serves."""

    def __init__(self, api, name, generation, since_seconds):
        self.api, self.name, self.generation = api, name, generation
        self.start = time.time() - since_seconds if since_seconds is not None else float("-inf")
        self.closed = False

    def stream(self, amt=None, decode_content=True):
        api, pos, served = self.api, 0, 0
        while True:
            with api.cond:
                log = api.containers[self.name][self.generation - 1]
                fresh = [(t, text) for t, text in log[pos:] if t >= self.start]
                pos = len(log)
                ended = (len(api.containers[self.name]) > self.generation or not api._running(self.name)
                         or self.closed)
                if not fresh and not ended:
                    api.cond.wait(0.02)
                    continue
            for t, text in fresh:
                if served == api.cut_after.get(self.name):
                    api.cut_after.pop(self.name)
                    return  # the connection dropped
                chunk = f"{stamp(t)} {text}\n".encode()
                api.served[self.name] = api.served.get(self.name, 0) + len(chunk)
                served += 1
                yield chunk[:7]  # a line may arrive in pieces
                yield chunk[7:]
            if ended and not fresh:
                return

    def close(self):
        self.closed = True

    def release_conn(self):
        pass


def stamp(t: float) -> str:
    """Unix time `t` as the runtime stamps a line: RFC3339Nano, trailing zeros trimmed."""
    import datetime

    at = datetime.datetime.fromtimestamp(int(t), datetime.UTC)
    frac = f"{round((t - int(t)) * 1e6) * 1000 + 7:09d}".rstrip("0")
    return at.strftime("%Y-%m-%dT%H:%M:%S") + f".{frac}Z"

def job_pod(labels, index, phase, **status):
    pod = pod_with(phase, **status)
    pod.metadata = k8s.V1ObjectMeta(name=f"p{index}", labels=dict(labels),
                                    annotations={k8s_manifests.COMPLETION_INDEX: str(index)})
    return pod


@pytest.mark.unit
def test_the_backend_deletes_a_cancelled_job_and_its_service_and_ignores_another_trys_pods():
    import logging

    from ballast.launch.kubernetes import KubernetesBackend

    spec = k8s_spec(nodes=2)
    api = FakeAPI()
    backend = KubernetesBackend(spec, logging.getLogger("test"), core=api, batch=api)
    handle = backend.start(launch(spec, 2))
    name = handle["name"]
    assert api.calls == [("create", f"Service/{name}"), ("create", f"Job/{name}")]
    other = dict(api.template_labels, **{k8s_manifests.TRY_LABEL: "1"})  # try 1's pod, still running
    api.strays = [job_pod(other, 0, "Running")]
    api.pods = [job_pod(api.template_labels, i, "Running") for i in range(2)]
    assert [p.metadata.name for p in backend.pods(handle)] == ["p0", "p1"]  # never the other try's
    lines: list[str] = []
    polls = iter([False, True])
    end = backend.wait(handle, on_line=lines.append, should_stop=lambda: next(polls))
    assert end.cancelled and lines == ["[0] log of p0", "[1] log of p1"]
    assert api.calls[2:] == [("delete", f"Job/{name}"), ("delete", f"Service/{name}")]


@pytest.mark.unit
def test_a_failed_job_reports_its_pods_reason_and_is_deleted_unless_kept():
    import logging

    from ballast.launch.kubernetes import KubernetesBackend

    for keep in (False, True):
        spec = k8s_spec(nodes=2, keep_failed_pods=keep)
        api = FakeAPI()
        backend = KubernetesBackend(spec, logging.getLogger("test"), core=api, batch=api)
        handle = backend.start(launch(spec, 1))
        api.pods = [job_pod(api.template_labels, 0, "Failed", exit_code=137, term_reason="OOMKilled"),
                    job_pod(api.template_labels, 1, "Failed", exit_code=72, term_reason="Error")]
        api.job_conditions = [k8s.V1JobCondition(type="Failed", status="True", reason="BackoffLimitExceeded")]
        end = backend.wait(handle, on_line=lambda line: None, should_stop=lambda: False)
        assert end.failure_class == "oom" and "OOMKilled" in end.reason and "BackoffLimitExceeded" in end.reason
        deleted = [c for c in api.calls if c[0] == "delete"]
        assert deleted == ([] if keep else [("delete", f"Job/{handle['name']}"),
                                            ("delete", f"Service/{handle['name']}")])


# --- one try's pods gone before the next starts; a deadline and a TTL on every try's objects -----------


@pytest.fixture
def clock(monkeypatch):
    from ballast.launch import kubernetes

    fake = FakeClock()
    monkeypatch.setattr(kubernetes, "time", fake)
    return fake


@pytest.mark.unit
@pytest.mark.parametrize("nodes", [1, 2])
def test_a_stopped_try_returns_once_its_pods_are_gone_and_the_next_try_starts_after(tmp_path, clock, nodes):
    import logging

    from ballast.launch import driver
    from ballast.launch.kubernetes import KubernetesBackend

    spec = k8s_spec(nodes=nodes)  # preempt_grace_seconds 90: the pods' terminationGracePeriodSeconds
    api = FakeAPI(clock, linger=40)  # the trainers take 40 s of their grace to commit a checkpoint
    log = logging.getLogger("test")
    backend = KubernetesBackend(spec, log, core=api, batch=api)
    out = tmp_path / "train"
    out.mkdir()
    first = launch(spec, 1)
    end = driver.run(backend, first, out, log, hang_timeout=0.0, heartbeat=True)  # no heartbeat: a hang
    assert api.pods == [] and 40 <= clock.now < 40 + 5  # stop() returned once they were gone, not before
    assert all(b.grace_period_seconds is None for b in api.delete_bodies)  # their grace: never a forced delete
    assert end.hung and not end.left_running and not (out / driver.JOB_LEASE).exists()
    assert driver.end_leftovers(lambda: backend, out, log) is None
    backend.start(launch(spec, 2))
    events = [what for _, what in api.timeline]
    assert events.index("pods gone") < events.index(f"create {launch(spec, 2).name}"), events


@pytest.mark.unit
def test_pods_that_outlive_their_grace_keep_the_lease_and_the_next_try_waits_for_them(tmp_path, clock,
                                                                                       monkeypatch):
    import logging

    from ballast.launch import driver
    from ballast.launch.kubernetes import STOP_MARGIN_SECONDS, KubernetesBackend
    from ballast.errors import LaunchError

    spec = k8s_spec(nodes=2)
    api = FakeAPI(clock, linger=float("inf"))  # a node that stopped answering: its pods stay listed
    log = logging.getLogger("test")
    backend = KubernetesBackend(spec, log, core=api, batch=api)
    out = tmp_path / "train"
    out.mkdir()
    end = driver.run(backend, launch(spec, 1), out, log, hang_timeout=0.0, heartbeat=True)
    assert end.hung and end.left_running and (out / driver.JOB_LEASE).exists()
    assert 90 + STOP_MARGIN_SECONDS <= clock.now <= 90 + STOP_MARGIN_SECONDS + 5  # bounded: grace + margin
    with pytest.raises(LaunchError, match=r"remote\.json: try 1's kubernetes job ballast-.*-t1 has not ended"):
        driver.end_leftovers(lambda: backend, out, log)  # the next try does not start beside them
    assert (out / driver.JOB_LEASE).exists()
    api.linger = 0  # the node came back and ended them
    assert driver.end_leftovers(lambda: backend, out, log)["try_number"] == 1
    assert not (out / driver.JOB_LEASE).exists() and api.pods == []


@pytest.mark.unit
@pytest.mark.parametrize("nodes,keep", [(1, False), (4, False), (4, True)])
def test_every_trys_job_and_pods_carry_a_deadline_and_a_job_a_ttl(nodes, keep):
    spec = k8s_spec(nodes=nodes, s3=nodes == 1, keep_failed_pods=keep)
    objs = docs(spec, launch(spec))
    for doc in objs:
        validate(doc)
    main = objs[-1]
    limit = 1440 * 60  # the spec's time limit: a train task that dies leaves nothing running past it
    assert pod_spec(main).get("activeDeadlineSeconds") == limit
    if nodes > 1:
        assert main["spec"]["activeDeadlineSeconds"] == limit
        assert main["spec"]["ttlSecondsAfterFinished"] == (k8s_manifests.KEPT_TTL_SECONDS if keep else
                                                           k8s_manifests.FINISHED_TTL_SECONDS)


@pytest.mark.unit
def test_the_deadline_is_the_specs_kubernetes_time_limit():
    spec = k8s_spec(nodes=2, time_limit_minutes=30)
    main = docs(spec, launch(spec))[-1]
    assert main["spec"]["activeDeadlineSeconds"] == 1800 == pod_spec(main)["activeDeadlineSeconds"]
    with pytest.raises(SpecError, match=r"execution\.kubernetes\.time_limit_minutes"):
        k8s_spec(time_limit_minutes=0)


# --- the log relay follows each pod's stream: every line once, in order; nothing read again -------------


@pytest.fixture
def fast_polls(monkeypatch):
    from ballast.launch import kubernetes
    from ballast.launch.kubernetes import logs

    monkeypatch.setattr(kubernetes, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(logs, "RETRY_SECONDS", 0.01)


def _log_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("log-")]


@pytest.mark.unit
def test_the_relay_follows_each_log_once_in_order_across_a_cut_and_restarts(fast_polls):
    """A Job's two pods: p0 logs a long backlog and its stream is cut twice (a reconnect asks only for the
    seconds since its last line: its lines are not served again, bar a few of overlap), then it fails and
    the Job replaces it (p0b, same completion index: its lines after p0's); p1's container restarts in
    place. Every line reaches the task's log once, in order per index; the bytes served stay within the
    logs' size plus the bounded overlap of each reconnect (re-reading the whole log every poll, as before,
    would serve it some hundred times); the followers are gone when wait returns."""
    import logging

    from ballast.launch.kubernetes import KubernetesBackend
    from ballast.launch.kubernetes.logs import OVERLAP_SECONDS

    spec = k8s_spec(nodes=2)
    api = FakeAPI()
    backend = KubernetesBackend(spec, logging.getLogger("test"), core=api, batch=api)
    handle = backend.start(launch(spec, 1))
    labels = api.template_labels
    p0, p1 = job_pod(labels, 0, "Running"), job_pod(labels, 1, "Running")
    api.pods = [p0, p1]
    backlog = [f"step {i} loss {1.0 / (i + 1):.6f}" for i in range(3000)]
    api.append("p0", *backlog)
    api.cut_after["p0"] = 1000  # the connection drops after 1000 lines, then again 700 into the next one
    relayed: list[str] = []

    def until(pred, what):
        """Polls (each relays what was read) until `pred` holds."""
        deadline = time.monotonic() + 20
        while not pred():
            assert time.monotonic() < deadline, f"{what}; relayed {len(relayed)} lines"
            yield

    def script():
        yield from until(lambda: len(api.reads) >= 2 and "p0" not in api.cut_after, "the first cut")
        api.cut_after["p0"] = 700
        api.append("p1", "p1 before restart 1", "p1 before restart 2")
        yield from until(lambda: "[1] p1 before restart 2" in relayed, "p1's first lines")
        api.restart("p1")
        api.append("p1", "p1 after restart")
        yield from until(lambda: f"[0] {backlog[-1]}" in relayed, "p0's backlog")
        api.append("p0", "p0 last words")
        p0.status.phase = "Failed"  # the Job replaces it: a new pod, a new name, the same index
        p0b = job_pod(labels, 0, "Running")
        p0b.metadata.name = "p0b"
        api.pods = [p0, p0b, p1]
        api.append("p0b", "p0b resumed")
        yield from until(lambda: "[0] p0b resumed" in relayed and "[1] p1 after restart" in relayed, "the last lines")
        for pod in api.pods[1:]:
            pod.status.phase = "Succeeded"
        api.job_conditions = [k8s.V1JobCondition(type="Complete", status="True")]
        while True:
            yield

    steps = script()
    end = backend.wait(handle, on_line=relayed.append, should_stop=lambda: next(steps) or False)
    assert end.ok
    index0 = [line for line in relayed if line.startswith("[0] ")]
    assert index0 == [f"[0] {t}" for t in ["log of p0", *backlog, "p0 last words", "log of p0b", "p0b resumed"]]
    assert [line for line in relayed if line.startswith("[1] ")] == [  # the restarted container's log: new lines
        "[1] log of p1", "[1] p1 before restart 1", "[1] p1 before restart 2", "[1] p1 after restart"]
    assert len(relayed) == len(index0) + len([line for line in relayed if line.startswith("[1] ")])
    size = {name: sum(len(f"{stamp(t)} {text}\n") for c in logs for t, text in c)
            for name, logs in api.containers.items()}
    reconnects = {name: sum(1 for n, since in api.reads if n == name and since is not None) for name in size}
    longest = max(len(f"{stamp(t)} {text}\n") for logs in api.containers.values() for c in logs for t, text in c)
    for name in size:
        assert api.served.get(name, 0) <= size[name] + reconnects[name] * (OVERLAP_SECONDS + 2) * longest, (
            name, api.served, size, reconnects)
    reads = {name: sum(1 for n, _ in api.reads if n == name) for name in size}
    # One stream each, and at most one more per cut, restart or end: not one read a poll.
    assert 3 <= reads["p0"] <= 4 and 2 <= reads["p1"] <= 3 and 1 <= reads["p0b"] <= 2, (reads, api.reads)
    assert _log_threads() == []


@pytest.mark.unit
def test_log_times_parse_and_lines_of_one_time_are_dropped_only_as_often_as_relayed():
    import logging
    import queue

    from ballast.launch.kubernetes.logs import Follower, parse_stamp

    assert parse_stamp("2026-12-05T06:13:07.123456789Z hello world") == ((1796451187, 123456789), "hello world")
    assert parse_stamp("2026-12-05T06:13:07.5Z x") == ((1796451187, 500000000), "x")
    assert parse_stamp("2026-12-05T07:13:07+01:00 x") == ((1796451187, 0), "x")
    assert parse_stamp("2026-12-05T06:13:07Z") == ((1796451187, 0), "")  # an empty write
    assert parse_stamp("not a time at all") == (None, "not a time at all")

    class Core:
        def __init__(self):
            self.streams = [[b"2026-12-05T06:13:07.5Z a\n2026-12-05T06:13:07.5Z b\n"],  # two lines, one time
                            [b"2026-12-05T06:13:06Z old\n2026-12-05T06:13:07.5Z a\n2026-12-05T06:13:07.5Z b\n"
                             b"2026-12-05T06:13:07.5Z c\n2026-12-05T06:13:08Z d"]]  # the reconnect's overlap

        def read_namespaced_pod_log(self, *args, **kwargs):
            chunks = self.streams.pop(0)
            return type("R", (), {"stream": lambda self, **kw: iter(chunks), "close": lambda self: None,
                                  "release_conn": lambda self: None})()

    out: queue.Queue = queue.Queue()
    f = Follower(Core(), "ml", "p0", "train", "", out, logging.getLogger("test"), seq=0)
    f._read_stream()
    f._read_stream()
    assert [out.get_nowait()[1] for _ in range(out.qsize())] == ["a", "b", "c", "d"]


@pytest.mark.unit
def test_a_follower_hung_on_an_ended_pod_is_stopped_and_the_replacements_lines_flow(monkeypatch):
    import logging
    import threading

    from ballast.launch.kubernetes import logs

    monkeypatch.setattr(logs, "CLOSE_SECONDS", 0.05)
    hung = threading.Event()

    class Core:
        def read_namespaced_pod_log(self, name, *args, **kwargs):
            if name == "p0":  # a lost node: the read never returns until the stream is closed

                class Stuck:
                    def stream(self, **kw):
                        hung.wait(30)
                        raise ConnectionError("closed")
                        yield b""

                    def close(self):
                        hung.set()

                    def release_conn(self):
                        pass

                return Stuck()
            return type("R", (), {"stream": lambda self, **kw: iter([b"2026-12-05T06:13:07Z resumed\n"]),
                                  "close": lambda self: None, "release_conn": lambda self: None})()

    relay = logs.PodLogs(Core(), "ml", "train", logging.getLogger("test"))
    old, new = job_pod({}, 0, "Running"), job_pod({}, 0, "Running")
    new.metadata.name = "p0b"
    relay.follow([old], prefix=lambda pod: "[0] ")
    old.status.phase = "Failed"
    relay.follow([old, new], prefix=lambda pod: "[0] ")
    lines: list[str] = []
    deadline = time.monotonic() + 10
    while "[0] resumed" not in lines:
        assert time.monotonic() < deadline, lines
        time.sleep(0.06)
        relay.follow([old, new], prefix=lambda pod: "[0] ")  # past CLOSE_SECONDS: the hung read is stopped
        relay.drain(lines.append)
    relay.close(lines.append, timeout=1.0)
    assert lines == ["[0] resumed"] and hung.is_set() and _log_threads() == []
