"""`ballast render SPEC [--try N]`: what a try would submit, printed without submitting it.

Kubernetes: the manifests as YAML (a pod, or a headless Service and an Indexed Job); Slurm: the
`sbatch` argument list and the batch script; local: the torchrun argument list. With `--after`, the
try follows earlier tries that failed so (`preempted`, `hang@HOST`, `oom`): what recovery adapts
(the pool, the avoid list, the micro-batch) shows in its objects.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ballast.launch import job_ref, launch_for
from ballast.pipeline.context import RunContext, safe_run_id
from ballast.errors import ConfigError
from ballast.records import Attempt
from ballast.recovery import adapt
from ballast.spec import Spec

PREVIEW_RUN = "manual__preview"


def earlier_tries(after: list[str]) -> list[Attempt]:
    """Failed tries from `CLASS[@HOST]` words, oldest first."""
    from ballast.training.failure import FAILURE_CLASSES

    tries = []
    for i, word in enumerate(after, start=1):
        cls, _, host = word.partition("@")
        if cls not in FAILURE_CLASSES:
            raise ConfigError(f"--after: {cls!r} is not a failure class ({', '.join(FAILURE_CLASSES)})")
        tries.append(Attempt(try_number=i, started=0.0, outcome="failed", failure_class=cls, host=host or "unknown"))
    return tries


def render(spec: Spec, *, try_number: int = 1, after: list[str] = (), run_id: str = PREVIEW_RUN) -> str:
    import yaml

    history = earlier_tries(list(after))
    if try_number <= len(history):
        raise ConfigError(f"--try {try_number}: {len(history)} earlier tries were given with --after; "
                          f"use --try {len(history) + 1} or more")
    settings, notes = adapt.next_settings(spec, history)
    ctx = RunContext(spec=spec, dag_id=spec.dag_id, run_id=run_id, try_number=try_number, task_id="train")
    head = [f"# {spec.dag_id}, try {try_number} on the {spec.execution.backend} backend"]
    head += [f"# adapting: {n}" for n in notes]
    backend = spec.execution.backend
    if backend == "local":
        from ballast.launch.config import torchrun_argv

        argv = torchrun_argv(spec, "run.json", run_id=f"{spec.dag_id}-{safe_run_id(run_id)}")
        return "\n".join(head + [shlex.join(argv)]) + "\n"
    ref = job_ref(ctx, try_number)
    python = spec.execution.slurm.python if backend == "slurm" and spec.execution.slurm else "python"
    root = getattr(ctx.storage, "root", None)
    launch = launch_for(spec, settings, dag_id=spec.dag_id, run_id=run_id, task_id="train", try_number=try_number,
                        job_ref=ref, python=python, shared_path=str(root) if root is not None else None)
    if backend == "kubernetes":
        from ballast.launch.kubernetes import manifests as k8s_manifests

        docs = k8s_manifests.as_dicts(k8s_manifests.objects(spec, launch))
        return "\n".join(head) + "\n" + yaml.safe_dump_all(docs, sort_keys=False)
    from ballast.launch.slurm import script as slurm_script

    script = Path("<job dir>") / "job.sh"
    export = slurm_script.job_environment(spec, os.environ)  # names only below: no value of the worker's is shown
    argv = slurm_script.sbatch_argv(spec, launch, script, log=Path("<job dir>") / "slurm.log", export=export)
    return "\n".join(head + ["# submitted as:", "# " + shlex.join(argv),
                             slurm_script.batch_script(spec, launch, export=export)])
