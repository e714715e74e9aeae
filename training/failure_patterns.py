"""Known error messages as data, and what an ended training process died of.

One table serves both sides: the trainer reads an exception's text through it
(`training.failure.classify`), the orchestrator reads torchrun's log tail and the backend's report
(`classify_exit`). Rows are ordered most specific first and the first row that matches anywhere in the
text wins, so a root cause (a bad GPU, an OOM) is named before what it causes in the other ranks (a
closed connection, a collective that never ends). Each row is tested with a real message in
tests/test_failure_patterns.py.

Choices for ambiguous messages:
- torch's NCCL watchdog timeout and gloo's "Timed out waiting ... for recv" are `hang`: some rank stopped
  taking part; if that rank wrote a failure record, the record wins.
- "illegal memory access", "device-side assert" and Xid 13/31/43 are `user_code`: nearly always a kernel or
  indexing bug; a failing GPU shows as Xid 48/63/64/74/79/94/95/119 or "uncorrectable ECC error".
  Xid 45 (cleanup after an earlier error) and "unspecified launch failure" match nothing: they follow
  another error.
- A bus error in DataLoader workers is /dev/shm exhausted, and a worker "killed by signal: Killed" is
  almost always the host OOM killer: both `oom`.
- After SIGKILL, Airflow logs "Likely out of memory error (OOM)": a guess, which matches nothing here.
  SIGKILL with no failure record is `unknown` unless the backend reports an OOM kill; SIGTERM with no
  record (the trainer writes one when it handles SIGTERM) is `preempted`.
- A gloo or NCCL "Connection closed by peer" in the log does not turn a record's user_code into
  communication: it is what the other ranks see when one dies of a bug (see OVERRIDE_FROM_LOG).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field

from ballast.training.failure_classes import CANCELLED, EXIT_CODES, FAILURE_CLASSES

OVERRIDE_RECORD = frozenset({"hardware", "communication", "oom"})
"""Classes that replace a record's user_code or unknown when the record's own exception text matches
them (a record written by a trainer with an older table)."""
OVERRIDE_FROM_LOG = frozenset({"hardware", "oom"})
"""Classes that replace a record's user_code or unknown when the log tail matches them: a CUDA ECC error
raised as a RuntimeError in the training loop is the GPU's fault, not the code's. Not communication: when
one rank dies of a bug, the others log "Connection closed by peer", and that must not make a bug retried."""


@dataclass(frozen=True)
class Pattern:
    """One row: text in which `pattern` (a regular expression; ^ and $ match at each line) is found is
    `failure_class`."""

    failure_class: str
    source: str  # who prints it: cuda, torch, nccl, gloo, torchelastic, xid, kernel, python, slurm, ...
    name: str  # short, for the reason line
    pattern: str
    regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "regex", re.compile(self.pattern, re.MULTILINE))


@dataclass(frozen=True)
class Match:
    failure_class: str
    name: str
    source: str
    line: str  # the whole line the match is on, stripped


@dataclass(frozen=True)
class Outcome:
    failure_class: str  # one of FAILURE_CLASSES, or CANCELLED
    reason: str  # one line: why
    line: str = ""  # the log line that decided it, if one did
    by: str = ""  # what decided it: cancelled, platform, record, hang, backend, log or exit


_XID = r"NVRM: Xid \([^)]*\): "  # "NVRM: Xid (PCI:0000:3b:00): 79, pid=..." as the driver writes to the kernel log
P = Pattern

PATTERNS: tuple[Pattern, ...] = (
    # hardware: the GPU, its memory or links, or the node; a retry on sound hardware may pass
    P("hardware", "xid", "Xid 48/94/95: ECC error", _XID + r"(?:48|94|95),"),
    P("hardware", "xid", "Xid 63/64: row remapping", _XID + r"6[34],"),
    P("hardware", "xid", "Xid 74: NVLink error", _XID + r"74,"),
    P("hardware", "xid", "Xid 79: GPU has fallen off the bus", _XID + r"79,|fallen off the bus"),
    P("hardware", "xid", "Xid 119: GSP RPC timeout", _XID + r"119,"),
    P("hardware", "cuda", "uncorrectable ECC error", r"uncorrectable ECC error"),
    P("hardware", "cuda", "CUDA devices busy or unavailable",
      r"CUDA-capable devices? ?(?:\(s\) is/are|are) busy or unavailable"),
    P("hardware", "torch", "no CUDA GPU visible", r"No CUDA GPUs are available|no CUDA-capable device is detected"),
    P("hardware", "cuda", "system not yet initialized", r"CUDA error: system not yet initialized"),  # NVSwitch fabric
    P("lost", "slurm", "Slurm node failure", r"CANCELLED AT \S+ DUE TO NODE FAILURE"),
    # oom: device or host memory, or shared memory; a retry with a smaller micro-batch may pass
    P("oom", "torch", "CUDA out of memory", r"OutOfMemoryError|CUDA out of memory"),
    P("oom", "cuda", "CUDA error: out of memory", r"CUDA error: out of memory"),
    P("oom", "cuda", "cuBLAS allocation failed", r"CUBLAS_STATUS_ALLOC_FAILED"),
    P("oom", "kernel", "cgroup OOM killer", r"Memory cgroup out of memory: Killed process|CONSTRAINT_MEMCG"),
    P("oom", "kernel", "kernel OOM killer", r"Out of memory: Killed process|invoked oom-killer|oom-kill:constraint="),
    P("oom", "slurm", "Slurm OOM kill", r"Detected \d+ oom[-_]kill events?|task \d+: Out Of Memory"),
    P("oom", "kubernetes", "Kubernetes OOMKilled", r"\bOOMKilled\b"),
    P("oom", "torch", "shared memory (/dev/shm) exhausted",
      r"insufficient shared memory \(shm\)|killed by signal: Bus error|^Bus error \(core dumped\)"),
    P("oom", "torch", "DataLoader worker killed (host OOM)",
      r"DataLoader worker \(pid \d+\) is killed by signal: Killed"),
    P("oom", "python", "host memory exhausted",
      r"\bMemoryError\b|Unable to allocate [\d.]+ \w+ for an array|\[Errno 12\] Cannot allocate memory"),
    P("oom", "cuda", "out of memory", r"(?i)(?<!likely )\bout of memory\b"),  # not Airflow's "Likely out of memory"
    # user_code: faults of the program, not the GPU
    P("user_code", "xid", "Xid 13/31/43: application fault", _XID + r"(?:13|31|43),"),
    P("user_code", "cuda", "CUDA kernel fault",
      r"an illegal (?:memory access|instruction) was encountered|device-side assert triggered|misaligned address"),
    P("user_code", "nccl", "invalid usage", r"ncclInvalidUsage|ncclInvalidArgument"),
    # config: the image or the run config does not fit the node
    P("config", "torch", "NCCL not built in", r"Distributed package doesn't have NCCL built in"),
    P("config", "torch", "torch without CUDA", r"Torch not compiled with CUDA enabled"),
    P("config", "cuda", "CUDA driver too old", r"CUDA driver version is insufficient for CUDA runtime version"),
    # data: the bytes on disk are wrong; a retry reads the same ones
    P("data", "torch", "truncated torch file", r"PytorchStreamReader failed reading zip archive"),
    P("data", "pyarrow", "not a Parquet file", r"Parquet magic bytes not found in footer"),
    # divergence
    P("divergence", "torch", "NaN in backward (anomaly mode)",
      r"Function '\w+' returned nan values in its \d+th output"),
    # preempted: told to stop from outside (a SIGTERM to torchrun, Slurm preemption)
    P("preempted", "torchelastic", "torchrun got SIGTERM",
      r"Received (?:Signals\.SIGTERM|15) death signal|got signal: (?:Signals\.SIGTERM|15)\b"),
    P("preempted", "slurm", "Slurm preemption", r"CANCELLED AT \S+ DUE TO PREEMPTION"),
    # hang: a collective that never completed
    P("hang", "nccl", "watchdog timeout", r"Watchdog caught collective operation timeout"),
    P("hang", "gloo", "operation timed out", r"Timed out waiting \d+ms for (?:recv|send) operation"),
    # gloo closes the pair once a collective outlives the group's timeout (distributed.timeout_seconds)
    P("hang", "gloo", "pair closed at the timeout", r"Application timeout caused pair closure"),
    # communication: the transport, the store or a peer
    P("communication", "nccl", "remote error",
      r"ncclRemoteError|remote process exited or there was a network error"),
    P("communication", "nccl", "unhandled system error", r"ncclSystemError|unhandled system error"),
    P("communication", "nccl", "internal error",
      r"ncclInternalError|internal error - please report this issue to the NCCL"),
    P("communication", "nccl", "unhandled CUDA error", r"ncclUnhandledCudaError|unhandled cuda error"),
    P("communication", "nccl", "backend error", r"\bNCCL error\b|DistBackendError"),
    P("communication", "gloo", "connectFullMesh failed", r"connectFullMesh failed"),
    P("communication", "gloo", "connection closed or reset by peer",
      r"Connection closed by (?:remote )?peer|Connection reset"),
    P("communication", "gloo", "transport error", r"gloo/transport/\S+\]"),
    P("communication", "torchelastic", "rendezvous failed",
      r"Rendezvous(?:Timeout|Closed|Connection|State)?Error"),
    P("communication", "torch", "c10d store unreachable",
      r"DistNetworkError|client socket has timed out after \S+ while trying to connect"),
    P("communication", "python", "connection refused or broken pipe", r"Connection refused|Broken pipe"),
)
del P

PLATFORM_ENDINGS: dict[tuple[str, str], str] = {
    # Slurm's job states (scontrol show job / sacct): the cgroup hit --mem; a higher-priority job took the
    # nodes; the time limit (the trainers had their --signal notice and checkpointed); a node died or never
    # came up; CANCELLED by someone other than Ballast (an administrator): the work was taken away.
    ("slurm", "OUT_OF_MEMORY"): "oom", ("slurm", "PREEMPTED"): "preempted", ("slurm", "TIMEOUT"): "preempted",
    ("slurm", "DEADLINE"): "preempted", ("slurm", "CANCELLED"): "preempted",
    ("slurm", "NODE_FAIL"): "lost", ("slurm", "BOOT_FAIL"): "hardware",
    # Kubernetes: a container's terminated reason, a pod's reason or phase, a DisruptionTarget condition's
    # reason. Evictions, drains, preemption, a graceful node shutdown and the try's deadline took the work
    # from a healthy job; a NoExecute taint: hardware; a pod whose node is gone, a node that stopped
    # reporting: lost (the ranks there ended without a word).
    ("kubernetes", "OOMKilled"): "oom", ("kubernetes", "Evicted"): "preempted",
    ("kubernetes", "DeadlineExceeded"): "preempted", ("kubernetes", "DisruptionTarget"): "preempted",
    ("kubernetes", "PreemptionByScheduler"): "preempted", ("kubernetes", "EvictionByEvictionAPI"): "preempted",
    ("kubernetes", "TerminationByKubelet"): "preempted", ("kubernetes", "DeletionByTaintManager"): "hardware",
    ("kubernetes", "DeletionByPodGC"): "lost", ("kubernetes", "NodeLost"): "lost",
    ("kubernetes", "Unknown"): "lost",
}
"""(platform, its own word for how a job or pod ended) -> failure class: the platform's half of the table,
read by `ballast.launch.slurm.status` and `ballast.launch.kubernetes.status`; `classify_exit` weighs what it gives against
the record. A word not here names no class (the failure record and the log decide)."""


def platform_class(platform: str, word: str | None) -> str | None:
    """The class a platform's word for an ending names (`PLATFORM_ENDINGS`), or None."""
    return PLATFORM_ENDINGS.get((platform, word or ""))


_LABELS = {"cuda": "CUDA", "nccl": "NCCL", "xid": "NVIDIA driver", "slurm": "Slurm", "kubernetes": "Kubernetes"}
_WORKER_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")  # torchrun: "failed (exitcode: -9) local_rank: 0 ..."
_WORKER_SIGNALLED = re.compile(r"exitcode\s*:\s*(-\d+)\)?\s*local_rank\s*:\s*(\d+)")
PLATFORM_OVER_RECORD = frozenset({"oom", "hardware", "preempted", "lost"})
"""Platform endings that replace a failure record's class: the node's memory, the node itself or the
scheduler ended the try, and the ranks' records are what they saw of it."""
SECONDARY = frozenset({"communication", "hang"})
"""Record classes that are often only what the other ranks see when one rank is killed outright."""


def _killed_worker(log_tail: str, record_rank: int | None) -> tuple[int, int] | None:
    """(local rank, negative exit code) of a worker torchrun reports ended by a signal, other than the
    record's rank (single node: local rank = rank)."""
    for m in _WORKER_SIGNALLED.finditer(log_tail):
        code, rank = int(m.group(1)), int(m.group(2))
        if rank != record_rank:
            return rank, code
    return None
_BY_CODE = {code: cls for cls, code in EXIT_CODES.items()}


def classify_text(text: str) -> Match | None:
    """The first row (in table order) found anywhere in `text` (an exception's text, a log tail)."""
    for row in PATTERNS:
        if m := row.regex.search(text):
            start = text.rfind("\n", 0, m.start()) + 1
            end = text.find("\n", m.end())
            line = text[start:] if end < 0 else text[start:end]
            return Match(row.failure_class, row.name, row.source, line.strip())
    return None


def _says(m: Match, says: str = "log line matches") -> str:
    return f"{says} {_LABELS.get(m.source, m.source)} '{m.name}' ({m.failure_class})"


def _signal_name(code: int) -> str | None:
    """The signal a return code stands for: -N (subprocess) or 128+N (a shell), if it names one."""
    num = -code if code < 0 else code - 128 if 128 < code < 160 else None
    try:
        return signal.Signals(num).name if num else None
    except ValueError:
        return None


def classify_exit(returncode: int | None, *, record: dict | None, log_tail: str = "", oom_killed: bool = False,
                  hung: bool = False, cancelled: bool = False, platform_class: str | None = None,
                  platform_reason: str = "") -> Outcome:
    """What a training try (torchrun and its workers, or a cluster job) died of: the one place that
    decides it. Its inputs: the exit status, the failure record (`failure.json`), the tail of the log,
    and what the backend reports: `platform_class`/`platform_reason` (a cluster's ending: Kubernetes'
    OOMKilled or eviction, Slurm's PREEMPTED or NODE_FAIL, in `ballast.launch.kubernetes.status` /
    `ballast.launch.slurm.status` words), `oom_killed` (cgroup memory.events oom_kill grew), `hung` (the orchestrator's
    heartbeat watch ended it), `cancelled` (the orchestrator stopped it: CANCELLED, not a failure).

    Precedence, first that applies: cancelled; the platform's ending (unless the hang guard ended the
    try, and over a record only for PLATFORM_OVER_RECORD); the failure record (a signal-killed peer
    before a SECONDARY record, a matching hardware or OOM text before user_code); the hang guard; the
    backend's OOM kill; a known line in the log; the exit status. Tested as a table in
    tests/test_classify.py and tests/test_failure_patterns.py."""
    if cancelled:
        return Outcome(CANCELLED, "cancelled: the orchestrator stopped it (not a failure)", by="cancelled")
    if platform_class is not None and not hung and (record is None or platform_class in PLATFORM_OVER_RECORD):
        cls = platform_class if platform_class in FAILURE_CLASSES else "unknown"
        return Outcome(cls, f"the platform ended it: {platform_reason or platform_class}", by="platform")
    if record is not None:
        cls = record.get("class")
        where = (f" on rank {record['rank']}" if record.get("rank") is not None else "") + \
                (f" at step {record['step']}" if record.get("step") is not None else "")
        if cls not in FAILURE_CLASSES:
            cls, where = "unknown", f"{where} (class {cls!r} is not a failure class)"
        killed = _killed_worker(log_tail, record.get("rank"))
        if cls in SECONDARY and killed is not None:
            # The record is what a peer saw: the rank that died first died of a signal, writing nothing.
            rank, code = killed
            sig = _signal_name(code)
            first = "preempted" if sig == "SIGTERM" else "lost"
            return Outcome(first, f"rank {rank} ended by {sig or code} without a failure record; the {cls} failure"
                                  f"{where} followed from it", by="record")
        if cls in ("user_code", "unknown"):
            m, says = classify_text(str(record.get("exception") or "")), "its exception matches"
            if not (m and m.failure_class in OVERRIDE_RECORD):
                m, says = classify_text(log_tail), "log line matches"
                m = m if m and m.failure_class in OVERRIDE_FROM_LOG else None
            if m:
                return Outcome(m.failure_class, f"failure record: class {cls}{where}, but {_says(m, says)}", m.line,
                               by="record")
        return Outcome(cls, f"failure record: class {cls}{where}", by="record")
    if hung:
        return Outcome("hang", "no progress within the hang timeout: the orchestrator ended it", by="hang")
    if oom_killed:
        return Outcome("oom", "the backend reports the OOM killer ended it", by="backend")
    m = classify_text(log_tail)
    if m:
        return Outcome(m.failure_class, _says(m), m.line, by="log")
    code, via = returncode, ""
    if returncode == 1 and (w := _WORKER_EXIT.search(log_tail)):  # torchrun exits 1 whenever a worker fails
        code, via = int(w.group(1)), "torchrun reports a worker's "
    if code is None:
        return Outcome("unknown", "no exit status and no failure record", by="exit")
    sig = _signal_name(code)
    if sig == "SIGKILL":  # the backend's OOM kill was weighed above: killed from outside, or its node went
        return Outcome("lost", f"{via}SIGKILL ({code}) with no failure record and no OOM kill reported: killed"
                               f" from outside, or its node lost", by="exit")
    if sig == "SIGTERM":
        return Outcome("preempted", f"{via}SIGTERM ({code}) with no failure record: preempted or drained from outside",
                       by="exit")
    if code in _BY_CODE:
        return Outcome(_BY_CODE[code], f"{via}exit code {code} ({_BY_CODE[code]}) with no failure record", by="exit")
    what = f"{sig} ({code})" if sig else f"exit code {code}"
    return Outcome("unknown", f"{via}{what} with no failure record and no known error in the log", by="exit")
