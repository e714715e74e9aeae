"""The failure-pattern table, case by case with messages as PyTorch, CUDA, NCCL, gloo, torchelastic, the
NVIDIA driver (Xid lines), the Linux kernel and Slurm print them; and what an ended training process
died of, from its record, its exit status, its log and what the backend reports."""

from __future__ import annotations

import pytest
import ballast.training.failure as tf
from ballast.training.failure_patterns import CANCELLED, PATTERNS, classify_exit, classify_text

pytestmark = pytest.mark.unit

CUDA_TAIL = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below"
             " might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with"
             " `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")

# (message as printed, class, row name)
REAL = [
    # hardware
    ("NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has"
     " been detected on GPU in the framebuffer at physAddr 0x7fdf0de80 partition 5, subpartition 1",
     "hardware", "Xid 48/94/95: ECC error"),
    ("NVRM: Xid (PCI:0000:01:00): 94, pid=7062, Contained: CE User Channel (0x9). RST: No, D-RST: No",
     "hardware", "Xid 48/94/95: ECC error"),
    ("NVRM: Xid (PCI:0000:01:00): 95, pid=7062, Uncontained: LTC TAG (0x2,0x0). RST: Yes, D-RST: No",
     "hardware", "Xid 48/94/95: ECC error"),
    ("May 19 07:08:57 ip-26-0-146-100 kernel: [680111.646286] NVRM: Xid (PCI:0000:10:1c): 63, pid=1850, Row"
     " Remapper: New row marked for remapping, reset gpu to activate",
     "hardware", "Xid 63/64: row remapping"),
    ("[2397166.923949] NVRM: Xid (PCI:0000:0f:00): 64, pid='<unknown>', name=<unknown>, Row Remapper Error:"
     " (0x00000002eebc4100) - All reserved rows for bank are remapped",
     "hardware", "Xid 63/64: row remapping"),
    ("[449410.332316] NVRM: Xid (PCI:0003:00:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error detected"
     " on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
     "hardware", "Xid 74: NVLink error"),
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
     "hardware", "Xid 79: GPU has fallen off the bus"),
    ("[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n               NVRM: (PCI ID: 10de:26b5) installed in this"
     " system has\n               NVRM: fallen off the bus and is not responding to commands.",
     "hardware", "Xid 79: GPU has fallen off the bus"),
    ("NVRM: Xid (PCI:0000:9b:00): 119, pid=4071838, name=python, Timeout after 45s of waiting for RPC response from"
     " GPU4 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20801702 0x4).",
     "hardware", "Xid 119: GSP RPC timeout"),
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered" + CUDA_TAIL,
     "hardware", "uncorrectable ECC error"),
    ("RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable" + CUDA_TAIL,
     "hardware", "CUDA devices busy or unavailable"),
    ("RuntimeError: CUDA error: all CUDA-capable devices are busy or unavailable",
     "hardware", "CUDA devices busy or unavailable"),
    ("RuntimeError: No CUDA GPUs are available", "hardware", "no CUDA GPU visible"),
    ("RuntimeError: CUDA error: no CUDA-capable device is detected" + CUDA_TAIL, "hardware", "no CUDA GPU visible"),
    ("RuntimeError: CUDA error: system not yet initialized" + CUDA_TAIL, "hardware", "system not yet initialized"),
    ("slurmstepd: error: *** JOB 1234 ON gpu-017 CANCELLED AT 2024-05-01T10:00:00 DUE TO NODE FAILURE, SEE"
     " SLURMCTLD LOG FOR DETAILS ***",
     "lost", "Slurm node failure"),
    # oom
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15"
     " GiB of which 1.23 GiB is free. Including non-PyTorch memory, this process has 77.91 GiB memory in use. Of"
     " the allocated memory 75.12 GiB is allocated by PyTorch, and 1.50 GiB is reserved by PyTorch but unallocated."
     " If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to"
     " avoid fragmentation.  See documentation for Memory Management "
     " (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
     "oom", "CUDA out of memory"),
    ("RuntimeError: CUDA out of memory. Tried to allocate 2.87 GiB (GPU 0; 14.76 GiB total capacity; 8.77 GiB"
     " already allocated; 19.75 MiB free; 13.71 GiB reserved in total by PyTorch)",
     "oom", "CUDA out of memory"),
    ("RuntimeError: CUDA error: out of memory" + CUDA_TAIL, "oom", "CUDA error: out of memory"),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
     "oom", "cuBLAS allocation failed"),
    ("[18026.221140] Memory cgroup out of memory: Killed process 140339 (python3) total-vm:120832kB,"
     " anon-rss:15596kB, file-rss:8924kB, shmem-rss:0kB, UID:0 pgtables:276kB oom_score_adj:-997",
     "oom", "cgroup OOM killer"),
    ("oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=cri-containerd-4f1c.scope,mems_allowed=0-1,"
     "oom_memcg=/kubepods.slice/kubepods-burstable.slice,task_memcg=/kubepods.slice/kubepods-burstable.slice,"
     "task=python,pid=1234,uid=0",
     "oom", "cgroup OOM killer"),
    ("[Sun Mar 30 08:24:00 2025] Out of memory: Killed process 7899 (python) total-vm:26184840kB,"
     " anon-rss:15370088kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:38964kB oom_score_adj:0",
     "oom", "kernel OOM killer"),
    ("[Sun Mar 30 08:24:00 2025] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,"
     "global_oom,task_memcg=/init.scope,task=python,pid=7899,uid=0",
     "oom", "kernel OOM killer"),
    ("[ 7093.543707] python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
     "oom", "kernel OOM killer"),
    ("slurmstepd: error: Detected 1 oom_kill event in StepId=11300781.0. Some of the step tasks have been OOM"
     " Killed.", "oom", "Slurm OOM kill"),
    ("srun: error: sdumont6156: task 0: Out Of Memory", "oom", "Slurm OOM kill"),
    ("    Last State:     Terminated\n      Reason:       OOMKilled\n      Exit Code:    137",
     "oom", "Kubernetes OOMKilled"),
    ("ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).",
     "oom", "shared memory (/dev/shm) exhausted"),
    ("RuntimeError: DataLoader worker (pid 46794) is killed by signal: Bus error. It is possible that dataloader's"
     " workers are out of shared memory. Please try to raise your shared memory limit.",
     "oom", "shared memory (/dev/shm) exhausted"),
    ("Bus error (core dumped)", "oom", "shared memory (/dev/shm) exhausted"),
    ("RuntimeError: DataLoader worker (pid 123) is killed by signal: Killed. ",
     "oom", "DataLoader worker killed (host OOM)"),
    ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\nMemoryError",
     "oom", "host memory exhausted"),
    ("numpy.core._exceptions._ArrayMemoryError: Unable to allocate 7.45 GiB for an array with shape (1000000000,)"
     " and data type float64", "oom", "host memory exhausted"),
    ("OSError: [Errno 12] Cannot allocate memory", "oom", "host memory exhausted"),
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled"
     " cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5\nncclUnhandledCudaError: Call to CUDA"
     " function failed.\nLast error:\nCuda failure 'out of memory'",
     "oom", "out of memory"),
    # user_code
    ("NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7,"
     " SM 0): Illegal Instruction Parameter", "user_code", "Xid 13/31/43: application fault"),
    ("NVRM: Xid (PCI:0000:00:07): 31, pid=2512125, name=python3.10, Ch 00000008, intr 00000000. MMU Fault: ENGINE"
     " GRAPHICS GPCCLIENT_T1_8 faulted @ 0x73ac_1c000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE",
     "user_code", "Xid 13/31/43: application fault"),
    ("[Wed Jul 31 23:14:18 2024] NVRM: Xid (PCI:0000:00:05): 43, pid=1045242, name=pt_main_thread, Ch 00000008",
     "user_code", "Xid 13/31/43: application fault"),
    ("RuntimeError: CUDA error: an illegal memory access was encountered" + CUDA_TAIL,
     "user_code", "CUDA kernel fault"),
    ("RuntimeError: CUDA error: device-side assert triggered" + CUDA_TAIL, "user_code", "CUDA kernel fault"),
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970,"
     " invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.19.3\nncclInvalidUsage: This usually"
     " reflects invalid usage of NCCL library.", "user_code", "invalid usage"),
    # config
    ("RuntimeError: Distributed package doesn't have NCCL built in", "config", "NCCL not built in"),
    ("AssertionError: Torch not compiled with CUDA enabled", "config", "torch without CUDA"),
    ("RuntimeError: CUDA error: CUDA driver version is insufficient for CUDA runtime version",
     "config", "CUDA driver too old"),
    # data
    ("RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory",
     "data", "truncated torch file"),
    ("pyarrow.lib.ArrowInvalid: Parquet magic bytes not found in footer. Either the file is corrupted or this is not"
     " a parquet file.", "data", "not a Parquet file"),
    # divergence
    ("RuntimeError: Function 'MseLossBackward0' returned nan values in its 0th output.",
     "divergence", "NaN in backward (anomaly mode)"),
    # preempted
    ("W0501 10:00:00.000000 140 torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal,"
     " shutting down workers", "preempted", "torchrun got SIGTERM"),
    ("WARNING:torch.distributed.elastic.agent.server.api:Received Signals.SIGTERM death signal, shutting down"
     " workers", "preempted", "torchrun got SIGTERM"),
    ("torch.distributed.elastic.multiprocessing.api.SignalException: Process 12345 got signal: 15",
     "preempted", "torchrun got SIGTERM"),
    ("slurmstepd: error: *** JOB 636782 ON n-805 CANCELLED AT 2026-07-02T16:04:53 DUE TO PREEMPTION ***",
     "preempted", "Slurm preemption"),
    # hang
    ("[rank0]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation"
     " timeout: WorkNCCL(SeqNum=7753, OpType=ALLREDUCE, NumelIn=544997376, NumelOut=544997376, Timeout(ms)=600000)"
     " ran for 600061 milliseconds before timing out.", "hang", "watchdog timeout"),
    ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms"
     " for recv operation to complete", "hang", "operation timed out"),
    ("RuntimeError: Application timeout caused pair closure", "hang", "pair closed at the timeout"),  # seen in CI
    # communication
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1347,"
     " remote process exited or there was a network error, NCCL version 2.18.5\nncclRemoteError: A call failed"
     " possibly due to a network error or a remote process exiting prematurely.", "communication", "remote error"),
    ("RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, unhandled system error,"
     " NCCL version 2.14.3\nncclSystemError: System call (e.g. socket, malloc) or external library call failed or"
     " device error.", "communication", "unhandled system error"),
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1333,"
     " internal error - please report this issue to the NCCL developers, NCCL version 2.18.1\nncclInternalError:"
     " Internal check failed.\nLast error:\nSocket recv failed while polling for opId=0x7f22ff731e10",
     "communication", "internal error"),
    ("RuntimeError: NCCL error in: /opt/pytorch/pytorch/torch/lib/c10d/ProcessGroupNCCL.cpp:260, unhandled cuda"
     " error, NCCL version 2.7.8\nncclUnhandledCudaError: Call to CUDA function failed.",
     "communication", "unhandled CUDA error"),
    ("torch.distributed.DistBackendError: [2] is setting up NCCL communicator and retrieving ncclUniqueId from [0]"
     " via c10d key-value store by key '0', but store->get('0') got error: Connection reset by peer",
     "communication", "backend error"),
    ("RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error",
     "communication", "connectFullMesh failed"),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:23456",
     "communication", "connection closed or reset by peer"),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [192.168.70.92]:25266:"
     " Connection reset by peer", "communication", "connection closed or reset by peer"),
    ("a100-st-p4d24xlarge-22:183006:183181 [1] misc/socket.cc:538 NCCL WARN Net : Connection closed by remote peer"
     " a100-st-p4d24xlarge-22<47861>", "communication", "connection closed or reset by peer"),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:799] connect [127.0.1.1]:35977: Connection"
     " refused", "communication", "transport error"),
    ("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError", "communication", "rendezvous failed"),
    ("RendezvousConnectionError: The connection to the C10d store has failed. See inner exception for details.",
     "communication", "rendezvous failed"),
    ("torch.distributed.elastic.rendezvous.api.RendezvousClosedError", "communication", "rendezvous failed"),
    ("torch.distributed.DistNetworkError: The client socket has timed out after 600000ms while trying to connect to"
     " (172.17.0.9, 46229).", "communication", "c10d store unreachable"),
    ("[E108 20:04:34.467642512 socket.cpp:957] [c10d] The client socket has timed out after 900s while trying to"
     " connect to (33.145.124.128, 29500).", "communication", "c10d store unreachable"),
    ("ConnectionRefusedError: [Errno 111] Connection refused", "communication", "connection refused or broken pipe"),
    ("BrokenPipeError: [Errno 32] Broken pipe", "communication", "connection refused or broken pipe"),
]

# Lines that must match nothing: follow-on errors, healthy runs' chatter, and guesses.
UNMATCHED = [
    "NVRM: Xid (PCI:0000:61:00): 45, pid=1496200, name=distprovers-gpu, Ch 0000000a",  # cleanup after another Xid
    "RuntimeError: CUDA error: unspecified launch failure",  # follows an Xid 13/31/43 or a hardware fault
    "Process terminated by signal. Likely out of memory error (OOM). For more information, see"
    " https://airflow.apache.org/docs/apache-airflow/stable/troubleshooting.html#process-terminated-by-signal.",
    "W0501 10:00:00.000000 140 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 198 closing"
    " signal SIGTERM",  # torchrun stopping the other workers after one failed: not a preemption
    "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
    "node1:1234:1250 [0] NCCL INFO [Service thread] Connection closed by localRank 0",
    "slurmstepd: error: *** JOB 1877080 ON r002 CANCELLED AT 2026-09-25T10:25:59 DUE TO TIME LIMIT ***",
    "RuntimeError: injected error at step 6 (fault injection)",
    "TypeError: unsupported operand type(s) for +: 'int' and 'str'",
]


@pytest.mark.parametrize("text,cls,name", REAL, ids=[f"{c}-{n}-{i}" for i, (_, c, n) in enumerate(REAL)])
def test_a_real_message_is_classified(text, cls, name):
    m = classify_text(text)
    assert m is not None, text
    assert (m.failure_class, m.name) == (cls, name)
    assert m.line and "\n" not in m.line and m.line in text


@pytest.mark.parametrize("text", UNMATCHED)
def test_follow_on_errors_chatter_and_guesses_match_nothing(text):
    assert classify_text(text) is None


def test_every_row_is_a_failure_class_and_has_a_real_message():
    assert {p.failure_class for p in PATTERNS} <= set(tf.FAILURE_CLASSES) - {"unknown"}
    assert len({p.name for p in PATTERNS}) == len(PATTERNS)
    assert {p.name for p in PATTERNS} == {name for _, _, name in REAL}


def test_the_root_cause_wins_over_what_it_causes_in_other_ranks():
    tail = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer"
            " [10.0.0.2]:23456\n[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5,"
            " OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600013 milliseconds before"
            " timing out.\nRuntimeError: CUDA error: uncorrectable ECC error encountered\n")
    m = classify_text(tail)
    assert (m.failure_class, m.line) == ("hardware", "RuntimeError: CUDA error: uncorrectable ECC error encountered")


def test_classes_exit_codes_and_retries():
    from ballast.training.failure_classes import ORCHESTRATOR_CLASSES

    assert set(tf.EXIT_CODES) == set(tf.FAILURE_CLASSES) - ORCHESTRATOR_CLASSES == set(tf.FAILURE_CLASSES) - {
        "unknown", "lost"}
    assert tf.EXIT_CODES["hardware"] == 74 and "unknown" not in tf.EXIT_CODES
    assert len(set(tf.EXIT_CODES.values())) == len(tf.EXIT_CODES)


@pytest.mark.parametrize("exc,cls", [
    (tf.HardwareFailure("GPU 0 lost"), "hardware"),
    (tf.DataFailure("shard-00001.parquet: missing"), "data"),
    (MemoryError(), "oom"),
    (type("OutOfMemoryError", (RuntimeError,), {})("injected out-of-memory at step 6 (fault injection)"), "oom"),
    (RuntimeError("CUDA error: out of memory"), "oom"),
    (RuntimeError("Gloo connectFullMesh failed: injected communication failure at step 6"), "communication"),
    (ConnectionResetError(104, "Connection reset by peer"), "communication"),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), "hardware"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "user_code"),
    (RuntimeError("injected error at step 6 (fault injection)"), "user_code"),
    (TypeError("unsupported operand type(s) for +: 'int' and 'str'"), "user_code"),
])
def test_the_trainer_classifies_exceptions_through_the_same_table(exc, cls):
    assert tf.classify(exc) == cls


def test_a_hardware_failure_record_says_so(tmp_path):
    rec = tf.write_record(tmp_path, RuntimeError("CUDA error: uncorrectable ECC error encountered"), step=3, rank=1)
    assert (rec["class"], rec["exit_code"]) == ("hardware", 74) and "retryable" not in rec  # the policy decides


ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
CLOSED = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:23456"
RECORD = {"class": "oom", "rank": 1, "step": 40, "exception": "OutOfMemoryError: CUDA out of memory."}
SIGKILL_REASON = ("SIGKILL (-9) with no failure record and no OOM kill reported: killed from outside, or its node"
                  " lost")


@pytest.mark.parametrize("kwargs,cls,reason", [
    (dict(returncode=1, record=RECORD, log_tail=CLOSED), "oom", "failure record: class oom on rank 1 at step 40"),
    (dict(returncode=1, record={"class": "user_code", "rank": 0, "step": 7, "exception": ECC}), "hardware",
     "failure record: class user_code on rank 0 at step 7, but its exception matches CUDA 'uncorrectable ECC error'"
     " (hardware)"),
    (dict(returncode=1, record={"class": "user_code", "rank": 0, "step": 7, "exception": "RuntimeError: boom"},
          log_tail=f"{CLOSED}\n{ECC}\n"), "hardware",
     "failure record: class user_code on rank 0 at step 7, but log line matches CUDA 'uncorrectable ECC error'"
     " (hardware)"),
    # A bug on one rank closes the others' connections: the record's user_code stands.
    (dict(returncode=1, record={"class": "user_code", "rank": 0, "step": 7, "exception": "TypeError: x"},
          log_tail=CLOSED), "user_code", "failure record: class user_code on rank 0 at step 7"),
    (dict(returncode=1, record={"class": "data", "rank": 0, "step": None}, log_tail=ECC), "data",
     "failure record: class data on rank 0"),
    (dict(returncode=-9, record=None), "lost", SIGKILL_REASON),
    # Rank 0 SIGKILLed (no record); rank 1 then records the reset connection: the kill is the cause.
    (dict(returncode=1, record={"class": "communication", "rank": 1, "step": 34},
          log_tail="E1203 15:58:17.025000 11173 torch/distributed/elastic/multiprocessing/api.py:836] failed"
                   " (exitcode: -9) local_rank: 0 (pid: 11186) of fn: worker (start_method: forkserver)"), "lost",
     "rank 0 ended by SIGKILL without a failure record; the communication failure on rank 1 at step 34 followed"
     " from it"),
    (dict(returncode=137, record=None, log_tail="Process terminated by signal. Likely out of memory error (OOM)."),
     "lost", "SIGKILL (137) with no failure record and no OOM kill reported: killed from outside, or its node lost"),
    (dict(returncode=1, record=None, log_tail="E0501 torch/distributed/elastic/multiprocessing/api.py:869] failed"
          " (exitcode: -9) local_rank: 0 (pid: 88) of binary: /usr/bin/python3"), "lost",
     "torchrun reports a worker's " + SIGKILL_REASON),
    (dict(returncode=-9, record=None, oom_killed=True), "oom", "the backend reports the OOM killer ended it"),
    (dict(returncode=-9, record=None, hung=True, log_tail=CLOSED), "hang",
     "no progress within the hang timeout: the orchestrator ended it"),
    (dict(returncode=-15, record=RECORD, cancelled=True), CANCELLED,
     "cancelled: the orchestrator stopped it (not a failure)"),
    (dict(returncode=73, record=None), "oom", "exit code 73 (oom) with no failure record"),
    (dict(returncode=74, record=None), "hardware", "exit code 74 (hardware) with no failure record"),
    (dict(returncode=-15, record=None), "preempted",
     "SIGTERM (-15) with no failure record: preempted or drained from outside"),
    (dict(returncode=1, record=None, log_tail=f"some output\n{CLOSED}\n"), "communication",
     "log line matches gloo 'connection closed or reset by peer' (communication)"),
    (dict(returncode=1, record=None, log_tail="RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/"
          "ProcessGroupNCCL.cpp:1275, unhandled system error, NCCL version 2.14.3"), "communication",
     "log line matches NCCL 'unhandled system error' (communication)"),
    (dict(returncode=-11, record=None), "unknown",
     "SIGSEGV (-11) with no failure record and no known error in the log"),
    (dict(returncode=2, record=None), "unknown", "exit code 2 with no failure record and no known error in the log"),
    (dict(returncode=None, record=None), "unknown", "no exit status and no failure record"),
    (dict(returncode=1, record={"class": "gremlins", "rank": 0}), "unknown",
     "failure record: class unknown on rank 0 (class 'gremlins' is not a failure class)"),
])
def test_what_a_training_process_died_of(kwargs, cls, reason):
    out = classify_exit(kwargs.pop("returncode"), **kwargs)
    assert (out.failure_class, out.reason) == (cls, reason)
    assert "\n" not in out.reason


def test_the_deciding_log_line_comes_back():
    out = classify_exit(1, record=None, log_tail=f"epoch 3\n{CLOSED}\nmore\n")
    assert out.line == CLOSED
