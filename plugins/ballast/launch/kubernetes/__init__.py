"""The Kubernetes backend: create one try's objects (`manifests`), follow its pods and relay their
logs as they stream (`logs`: one follower thread a pod, nothing read twice), read how they ended
(`status`), delete them.

The API clients are the provider's `KubernetesHook` (an Airflow connection, `execution.kubernetes.
conn_id`: the cluster's credentials never pass through the spec). Pods are found by this try's labels,
run and try number both (`ballast.dev/run`, `ballast.dev/try`), and every pod found is checked for
them again: a retry never attaches to a pod or Job of another try, which the provider's own label
selector, leaving the try number out on purpose, would allow. A try's objects are deleted when it
succeeds, fails (unless `keep_failed_pods`), is cancelled, or is found left over by the next try; a
stop returns once the try's pods are gone (they may spend their grace period committing a checkpoint
into the storage the next try resumes from), or reports that they are not, after that grace period and
a margin: the try's lease then stays (`ballast.launch.driver`).

Not run against a cluster here (none runs on these machines): the objects are validated offline, and
this module's calls are tested against a recording stand-in for the API (tests/test_kubernetes.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ballast.launch import Ending, Launch
from ballast.launch.kubernetes import logs as k8s_logs, manifests as k8s_manifests, status as k8s_status
from ballast.spec import Spec

POLL_SECONDS = 2.0
STOP_MARGIN_SECONDS = 30.0
"""How long past the pods' grace period a stop waits for them to be gone (the kubelet's own pace)."""


class KubernetesBackend:
    name = "kubernetes"

    def __init__(self, spec: Spec, log: Any, *, core: Any = None, batch: Any = None):
        self.spec, self.log = spec, log
        self.k = spec.execution.kubernetes
        if core is None or batch is None:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

            hook = KubernetesHook(conn_id=self.k.conn_id)
            core, batch = hook.core_v1_client, hook.batch_v1_client
        self.core, self.batch = core, batch

    # -- start -------------------------------------------------------------------------------------

    def start(self, launch: Launch) -> dict[str, Any]:
        ns = self.k.namespace
        objs = k8s_manifests.objects(self.spec, launch)
        for obj in objs:
            if obj.kind == "Pod":
                self.core.create_namespaced_pod(ns, obj)
            elif obj.kind == "Service":
                self.core.create_namespaced_service(ns, obj)
            else:
                self.batch.create_namespaced_job(ns, obj)
        kind = "Pod" if launch.nodes == 1 else "Job"
        labels = objs[-1].metadata.labels
        self.log.info("created %s %s/%s (%d node(s), try %d)", kind, ns, launch.name, launch.nodes, launch.try_number)
        return {"backend": self.name, "kind": kind, "name": launch.name, "namespace": ns,
                "try_number": launch.try_number, "run": labels[k8s_manifests.RUN_LABEL]}

    # -- watch -------------------------------------------------------------------------------------

    def pods(self, handle: dict[str, Any]) -> list[Any]:
        """This try's pods: found by run and try labels, and each checked for both again."""
        selector = f"{k8s_manifests.RUN_LABEL}={handle['run']},{k8s_manifests.TRY_LABEL}={handle['try_number']}"
        found = self.core.list_namespaced_pod(handle["namespace"], label_selector=selector).items
        ours = []
        for pod in found:
            labels = pod.metadata.labels or {}
            if labels.get(k8s_manifests.TRY_LABEL) == str(handle["try_number"]) and \
                    labels.get(k8s_manifests.RUN_LABEL) == handle["run"]:
                ours.append(pod)
            else:
                self.log.warning("ignoring pod %s: not of try %s", pod.metadata.name, handle["try_number"])
        return ours

    def wait(self, handle: dict[str, Any], *, on_line: Callable[[str], Any], should_stop: Callable[[], bool]) -> Ending:
        relay = k8s_logs.PodLogs(self.core, handle["namespace"], k8s_manifests.CONTAINER, self.log)
        try:
            while True:
                if should_stop():
                    ended = self.stop(handle, reason="cancelled")
                    relay.close(on_line)  # the pods are gone: what they logged in their grace period too
                    return Ending(None, reason="cancelled (by Ballast)", cancelled=True, left_running=not ended)
                pods = self.pods(handle)
                relay.follow(pods, prefix=_prefix)
                relay.drain(on_line)
                end = self._ended(handle, pods)
                if end is not None:
                    if end.ok or not self.k.keep_failed_pods:
                        end = dataclasses.replace(end, left_running=not self.stop(handle, reason="finished"))
                    else:
                        self.log.warning("keeping the failed try's %s %s for inspection (keep_failed_pods)",
                                         handle["kind"], handle["name"])
                    relay.close(on_line)  # every pod's log to its end (a Job's peers stop after the first)
                    return end
                time.sleep(POLL_SECONDS)
        finally:
            relay.close(on_line, timeout=0.0)  # an error on the way: the followers end with it

    def _ended(self, handle: dict[str, Any], pods: list[Any]) -> Ending | None:
        if handle["kind"] == "Pod":
            return k8s_status.ending(pods[0]) if pods else None
        job = self.batch.read_namespaced_job_status(handle["name"], handle["namespace"])
        for cond in (job.status.conditions or []) if job.status else []:
            if cond.status != "True":
                continue
            if cond.type == "Complete":
                return Ending(0, reason="Complete")
            if cond.type == "Failed":
                first = k8s_status.first_failure(pods)
                reason = f"Job failed: {cond.reason or ''} {cond.message or ''}".strip()
                if first is None:  # the time limit (activeDeadlineSeconds) is Slurm's TIMEOUT: resume
                    return Ending(None, reason=reason,
                                  failure_class="preempted" if cond.reason == "DeadlineExceeded" else None)
                return Ending(first.exit_code, host=first.host, reason=f"{first.reason}; {reason}",
                              failure_class=first.failure_class)
        return None

    # -- stop --------------------------------------------------------------------------------------

    def stop(self, handle: dict[str, Any], *, reason: str = "") -> bool:
        """Delete the try's objects (a Job with its pods, foreground; its Service; or the pod) and wait
        until its pods are gone; False if some still ran after their grace period and a margin."""
        from kubernetes.client import V1DeleteOptions
        from kubernetes.client.exceptions import ApiException

        ns, name = handle["namespace"], handle["name"]
        # The pods' own grace period, never a forced delete: that would only drop them from the API while
        # their trainers still run and write into storage beside the next try.
        body = V1DeleteOptions(propagation_policy="Foreground")
        calls = ([(self.core.delete_namespaced_pod, name)] if handle.get("kind") == "Pod" else
                 [(self.batch.delete_namespaced_job, name), (self.core.delete_namespaced_service, name)])
        for delete, obj in calls:
            try:
                delete(obj, ns, body=body)
            except ApiException as exc:
                if exc.status != 404:  # already gone is what we wanted
                    raise
        self.log.info("deleted %s %s/%s (%s)", handle.get("kind"), ns, name, reason or "stopped")
        return self._gone(handle)

    def lease(self, handle: dict[str, Any]) -> dict[str, Any]:
        return handle  # what `stop` needs of the try's objects, for the next try (the driver's lease)

    def describe(self, handle: dict[str, Any]) -> dict[str, Any]:
        return {"job": handle["name"]}

    def _gone(self, handle: dict[str, Any]) -> bool:
        """Wait until no pod of the try runs (none listed, or all terminated), at most the pods' grace
        period and STOP_MARGIN_SECONDS."""
        bound = k8s_manifests.grace_seconds(self.spec) + STOP_MARGIN_SECONDS
        deadline = time.monotonic() + bound
        while True:
            left = [p.metadata.name for p in self.pods(handle)
                    if (p.status.phase if p.status else None) not in ("Succeeded", "Failed")]
            if not left:
                return True
            if time.monotonic() >= deadline:
                self.log.error("pods %s of try %s still run %.0f s after their deletion", ", ".join(left),
                               handle.get("try_number"), bound)
                return False
            time.sleep(POLL_SECONDS)


def _prefix(pod: Any) -> str:
    """A Job's pod's lines carry its completion index; a lone pod's none."""
    index = (pod.metadata.annotations or {}).get(k8s_manifests.COMPLETION_INDEX)
    return f"[{index}] " if index is not None else ""
