"""How a training pod ended, read from its status as the API server reports it, in recovery's classes
(each reason's class is the pattern table's, `training.failure_patterns.PLATFORM_ENDINGS`).

The provider's failure says only "Pod X returned a failure."; the reasons live in the pod:

- the container's `terminated.reason` OOMKilled (the cgroup's OOM killer): `oom`;
- the pod's `reason: Evicted` (the kubelet reclaimed the node's memory or disk): `preempted`: the work
  was taken away from a healthy job, and a new try on another node is the cure;
- the `DisruptionTarget` condition's reason: PreemptionByScheduler (a higher priority pod needed the
  node), EvictionByEvictionAPI (a drain), TerminationByKubelet (a graceful node shutdown, spot
  reclamation): `preempted`; DeletionByTaintManager (the node turned NoExecute: not ready,
  unreachable) and DeletionByPodGC (the pod's node is gone): `hardware`, the node goes on the avoid list;
- a pod whose node disappeared (`reason: NodeLost`, phase Unknown): `hardware`;
- the try's time limit (`reason: DeadlineExceeded`, activeDeadlineSeconds: the trainers had SIGTERM and
  their grace to checkpoint, as at Slurm's time limit): `preempted`, a new try resumes;
- otherwise the container's exit code: one of the trainer's class codes, or nothing the platform
  knows (the failure record and the log decide).
"""

from __future__ import annotations

from typing import Any

from ballast.launch import Ending

CONTAINER = "train"


def _class(word: str | None) -> str | None:
    from ballast.training.failure_patterns import platform_class  # its regexes compile at import: not at parse

    return platform_class("kubernetes", word)


def _get(obj: Any, *names: str) -> Any:
    for name in names:
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return obj


def _terminated(pod: Any) -> Any:
    for cs in _get(pod, "status", "container_statuses") or []:
        if _get(cs, "name") == CONTAINER:
            return _get(cs, "state", "terminated") or _get(cs, "last_state", "terminated")
    return None


def ending(pod: Any) -> Ending | None:
    """The ending of a pod that has ended (None while it runs or waits): a `V1Pod`."""
    status = _get(pod, "status")
    phase = _get(status, "phase")
    host = _get(pod, "spec", "node_name")
    term = _terminated(pod)
    code = _get(term, "exit_code")
    for cond in _get(status, "conditions") or []:
        if _get(cond, "type") == "DisruptionTarget" and _get(cond, "status") == "True":
            reason = _get(cond, "reason") or "DisruptionTarget"
            message = _get(cond, "message") or ""
            return Ending(code, host=host, reason=f"{reason}: {message}".rstrip(": "),
                          failure_class=_class(reason) or _class("DisruptionTarget"))
    pod_reason = _get(status, "reason")
    if pod_reason in ("Evicted", "DeadlineExceeded"):
        return Ending(code, host=host, reason=f"{pod_reason}: {_get(status, 'message') or ''}".rstrip(": "),
                      failure_class=_class(pod_reason))
    if pod_reason == "NodeLost" or phase == "Unknown":
        return Ending(code, host=host, reason=f"{pod_reason or 'Unknown'}: the pod's node stopped reporting",
                      failure_class=_class(pod_reason) or _class("Unknown"))
    if phase not in ("Succeeded", "Failed"):
        return None
    if term is not None and _get(term, "reason") == "OOMKilled":
        return Ending(code, host=host, reason="OOMKilled", failure_class=_class("OOMKilled"))
    if phase == "Succeeded":
        return Ending(0 if code is None else code, host=host, reason=_get(term, "reason") or "Completed")
    return Ending(code, host=host, reason=_get(term, "reason") or pod_reason or "Failed")


def first_failure(pods: list[Any]) -> Ending | None:
    """Of a Job's pods, the ending that explains the Job's: a platform reason first (a preempted pod's
    peers fail after it, with a communication error), else the earliest failed container."""
    endings = [(pod, e) for pod in pods if (e := ending(pod)) is not None and not e.ok]
    if not endings:
        return None
    platform = [e for _, e in endings if e.failure_class is not None]
    if platform:
        return platform[0]

    def finished(item: tuple[Any, Ending]) -> Any:
        at = _get(_terminated(item[0]), "finished_at")
        return (at is None, at)

    return min(endings, key=finished)[1]
