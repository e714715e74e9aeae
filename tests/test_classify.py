"""The one classification of an ended try (training.failure_patterns.classify_exit), as a table of its
precedence: cancelled, then the platform's ending, the failure record, the hang guard, the backend's OOM
kill, a known log line, the exit status. Each row gives every input and what decides."""

from __future__ import annotations

import pytest

from ballast.training.failure_classes import CANCELLED
from ballast.training.failure_patterns import classify_exit

pytestmark = pytest.mark.unit

BUG = {"class": "user_code", "rank": 0, "step": 7, "exception": "TypeError: x"}
PEER = {"class": "communication", "rank": 1, "step": 7, "exception": "RuntimeError: Connection closed by peer"}
ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
GLOO = "RuntimeError: [gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:23456"

# (inputs, class, what decided)
TABLE = [
    # cancelled beats everything, the platform's word included
    (dict(rc=-15, record=BUG, cancelled=True, platform_class="preempted", hung=True), CANCELLED, "cancelled"),
    # the platform's ending beats a record for oom, hardware and preempted
    (dict(rc=1, record=PEER, platform_class="preempted"), "preempted", "platform"),
    (dict(rc=1, record=BUG, platform_class="oom", log_tail=GLOO), "oom", "platform"),
    (dict(rc=137, record=None, platform_class="hardware"), "hardware", "platform"),
    # ... but not one the hang guard ended: the record (or the hang) stands
    (dict(rc=-9, record=BUG, platform_class="preempted", hung=True), "user_code", "record"),
    (dict(rc=-9, record=None, platform_class="preempted", hung=True), "hang", "hang"),
    # a record beats the hang guard, the backend's OOM kill, the log and the exit status
    (dict(rc=1, record=BUG, hung=True, oom_killed=True, log_tail=GLOO), "user_code", "record"),
    (dict(rc=1, record=BUG, log_tail=ECC), "hardware", "record"),  # the record's user_code, but the GPU failed
    # no record: the hang guard, then the backend's OOM kill, then the log, then the exit status
    (dict(rc=-9, record=None, hung=True, oom_killed=True, log_tail=ECC), "hang", "hang"),
    (dict(rc=-9, record=None, oom_killed=True, log_tail=GLOO), "oom", "backend"),
    (dict(rc=1, record=None, log_tail=GLOO), "communication", "log"),
    (dict(rc=73, record=None), "oom", "exit"),
    (dict(rc=-15, record=None), "preempted", "exit"),
    (dict(rc=-9, record=None), "lost", "exit"),
    (dict(rc=None, record=None), "unknown", "exit"),
]


@pytest.mark.parametrize("inputs,cls,by", TABLE, ids=[f"{i}-{c}-by-{b}" for i, (_, c, b) in enumerate(TABLE)])
def test_the_precedence_of_what_decides_a_tries_class(inputs, cls, by):
    inputs = dict(inputs)
    out = classify_exit(inputs.pop("rc"), **inputs)
    assert (out.failure_class, out.by) == (cls, by)
    assert out.reason and "\n" not in out.reason


def test_the_platform_reason_is_the_reason():
    out = classify_exit(1, record=None, platform_class="preempted", platform_reason="PREEMPTED (None)")
    assert out.reason == "the platform ended it: PREEMPTED (None)"


def test_a_platform_class_outside_the_vocabulary_is_unknown():
    assert classify_exit(1, record=None, platform_class="gremlins").failure_class == "unknown"


def test_failure_and_its_patterns_do_not_import_each_other():
    import ast
    from pathlib import Path

    import ballast.training.failure as failure
    import ballast.training.failure_patterns as patterns

    def imports(module) -> set[str]:
        tree = ast.parse(Path(module.__file__).read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert "ballast.training.failure" not in imports(patterns)
    assert "ballast.training.failure_patterns" in imports(failure)


def test_the_platforms_words_are_the_tables_and_name_failure_classes():
    from ballast.training.failure_classes import FAILURE_CLASSES
    from ballast.training.failure_patterns import PLATFORM_ENDINGS, platform_class

    assert set(PLATFORM_ENDINGS.values()) <= set(FAILURE_CLASSES)
    assert [platform_class("slurm", w) for w in ("OUT_OF_MEMORY", "TIMEOUT", "NODE_FAIL", "FAILED", None)] == \
        ["oom", "preempted", "lost", None, None]
    assert platform_class("kubernetes", "DeletionByTaintManager") == "hardware"
    assert platform_class("kubernetes", "NodeLost") == platform_class("kubernetes", "DeletionByPodGC") == "lost"
