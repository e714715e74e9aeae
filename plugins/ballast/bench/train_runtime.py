"""Training-runtime benchmarks, each under real torchrun processes (gloo on CPU here):

* `overhead`: samples/s of the trainer with every monitor on (spike detector, gradient statistics,
  watchdog, heartbeat, Prometheus endpoint, per-step agreed flags) against training/baseline.py, a
  plain hand-written DDP loop on the same model, data and order. Runs alternate; target >= 0.95x.
* `checkpoint`: time training is blocked by an asynchronous save against a synchronous save of the
  same ~1 GiB state (weights + AdamW moments), target <= 10%; and samples/s with a checkpoint every
  30 s against none (100 s runs, five alternating pairs, median ratio), target >= 0.97x.
* `recovery`: seconds from a rank killed with SIGKILL to the next completed step after torchrun
  restarts the group from the latest committed checkpoint; median and spread; target median <= 5 s.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ballast.bench.measure import target
from ballast.records import WarmCacheResult
from ballast.training.outputs import read_summary


def _prepare(root: Path, *, rows: int, shape: tuple[int, ...], edit) -> tuple[Any, WarmCacheResult]:
    """Synthetic data converted and cached by the real stages; returns (spec, warm_cache result)."""
    import yaml

    from ballast.pipeline.context import RunContext
    from ballast.data.demo import write_synthetic
    from ballast.spec import parse_spec
    from ballast.stages import convert, validate, warm_cache

    raw = root / "raw"
    write_synthetic(raw, rows=rows, shape=shape, seed=1)
    example = Path(__file__).resolve().parents[3] / "dags" / "specs" / "digits.yaml"
    d = yaml.safe_load(example.read_text())
    d["dataset"].update(location=str(raw), fields=[{"name": "image", "type": "float32", "shape": list(shape)},
                                                   {"name": "label", "type": "int64"}])
    d["validation"]["rules"] = []
    d["conversion"].update(formats=["petastorm"], shard_rows=5000)
    d["storage"]["uri"] = str(root / "storage")
    d["cache"]["directory"] = str(root / "cache")
    d["evaluation"].update(patience=1000, threshold=None)
    edit(d)
    spec = parse_spec(d)
    ctx = RunContext(spec=spec, dag_id="bench", run_id="bench")
    for module in (validate, convert, warm_cache):
        name = module.__name__.rsplit(".", 1)[-1]
        ctx.save_result(name, module.run(ctx))
    warm_cache.warm_rest(ctx)
    return spec, ctx.result("warm_cache")


def _config(spec, cache: WarmCacheResult, run_dir: Path, changes: dict[str, Any] | None = None) -> Path:
    """The run config of one bench run, with `{"section.field": value}` changes (validated)."""
    from ballast.launch.config import run_config

    cfg = run_config(spec, data_dir=cache.cache_dir, data_format=cache.format,
                     checkpoint_dir=str(run_dir / "ckpt"), output_dir=str(run_dir / "out"))
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "run.json"
    cfg.updated(changes or {}).dump(path)
    return path


def _torchrun(config: Path, *, module: str = "ballast.training", nproc: int = 2, extra: tuple[str, ...] = (),
              timeout: float = 1800, preload: bool = False) -> subprocess.CompletedProcess:
    launcher = "ballast.training.torchrun" if module == "ballast.training" and preload else "torch.distributed.run"
    argv = [sys.executable, "-m", launcher, "--standalone", f"--nproc-per-node={nproc}",
            "--monitor-interval=0.1", *extra, "--module", module, "--config", str(config)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def _events(run_dir: Path) -> list[dict]:
    from ballast.training.outputs import read_events

    return [e.model_dump() for e in read_events(run_dir / "out")]


def bench_overhead(*, repeat: int = 5, epochs: int = 6) -> dict:
    def edit(d):
        d["training"].update(model="mlp", hidden_size=1024, micro_batch_size=128, global_batch_size=256,
                             processes_per_node=2, epochs=epochs, checkpoint={"every_seconds": 31_536_000})

    with tempfile.TemporaryDirectory(prefix="ballast-bench-overhead-") as tmp:
        root = Path(tmp)
        spec, cache = _prepare(root, rows=24_000, shape=(32, 32), edit=edit)
        ours, plain = [], []
        # Pairs run back to back, alternating which goes first; the machine is shared and noisy, so the
        # median of the per-pair ratios is reported.
        for i in range(repeat):
            order = ("trainer", "plain") if i % 2 == 0 else ("plain", "trainer")
            for kind in order:
                run = root / f"{kind}-{i}"
                if kind == "trainer":
                    _torchrun(_config(spec, cache, run, {"execution.metrics_port": _free_port_block(2)}))
                    ours.append(read_summary(run / "out").samples_per_second)
                else:
                    _torchrun(_config(spec, cache, run), module="ballast.training.baseline")
                    plain.append(json.loads((run / "out" / "baseline.json").read_text())["samples_per_second"])
    ratios = [a / b for a, b in zip(ours, plain)]
    ratio = statistics.median(ratios)
    return {
        "benchmark": "overhead", "processes": 2, "model": "mlp hidden 1024, input 32x32, micro-batch 128",
        "monitors": "spike detector, gradient statistics every 50 steps, watchdog, heartbeat, Prometheus "
                    "endpoint, per-step agreed flags, async epoch-end checkpoints",
        "trainer_samples_per_second": ours, "plain_ddp_samples_per_second": plain, "ratios": ratios,
        "targets": {"trainer_vs_plain_ddp": target(round(ratio, 4), 0.95, lower_is_better=False)},
    }


def bench_checkpoint(*, hidden: int = 9000, interval_run_seconds: float = 100.0, pairs: int = 5) -> dict:
    # mlp 1024 -> hidden -> hidden -> 10: ~90M parameters at hidden 9000 = 0.36 GB of weights, and AdamW's
    # two moments make the saved state ~1.1 GB.
    # Loss-spike alerts off: this random-label model spikes, and an alert's anomaly checkpoint would put
    # saves into the runs without checkpoints.
    def edit(d):
        d["training"].update(model="mlp", hidden_size=hidden, micro_batch_size=16, global_batch_size=32,
                             processes_per_node=2, epochs=1000, checkpoint={"every_seconds": 31_536_000},
                             monitors={"spike_zscore": 1e9})

    with tempfile.TemporaryDirectory(prefix="ballast-bench-checkpoint-") as tmp:
        root = Path(tmp)
        spec, cache = _prepare(root, rows=6_000, shape=(32, 32), edit=edit)
        blocked: dict[str, list[float]] = {}
        state_bytes = 0
        for mode in ("sync", "async"):
            run = root / mode
            # Save every 4 steps, 5 saves; the epoch bound ends the run early.
            cfg = _config(spec, cache, run, {"checkpoint.asynchronous": mode == "async", "checkpoint.every_steps": 4,
                                             "epochs": 1, "checkpoint.keep_last": 2, "rehearsal.max_steps": 20})
            _torchrun(cfg)
            events = [e for e in _events(run) if e["event"] == "checkpoint" and e["reason"] == "interval"]
            blocked[mode] = [e["blocked_seconds"] for e in events]
            newest = sorted((run / "ckpt").glob("step-*"))[-1]
            state_bytes = sum(p.stat().st_size for p in newest.iterdir() if p.suffix == ".pt")
        # Throughput with a checkpoint every 30 s against none, over runs of the same length, in pairs run
        # back to back with alternating order (the machine is shared and noisy): the median pair ratio.
        rates: dict[str, list[dict]] = {"none": [], "every_30s": []}
        for i in range(pairs):
            order = (("none", 31_536_000.0), ("every_30s", 30.0))
            for label, every in (order if i % 2 == 0 else order[::-1]):
                run = root / f"rate-{label}-{i}"
                cfg = _config(spec, cache, run, {"checkpoint.asynchronous": True, "checkpoint.every_seconds": every,
                                                 "epochs": 1, "rehearsal.max_seconds": interval_run_seconds})
                _torchrun(cfg)
                summary = read_summary(run / "out").model_dump()
                events = _events(run)
                saves = [e for e in events if e["event"] == "checkpoint" and e["reason"] == "interval"]
                # Each interval save's background write must be done inside the timed window, or part of
                # its cost would fall after it (the writer runs at idle priority and is waited for after).
                end = next((e["time"] for e in events if e["event"] in ("budget_reached", "epoch")), float("inf"))
                written = {e["step"]: e for e in events if e["event"] == "checkpoint_written"}
                late = [s["step"] for s in saves if s["step"] not in written or written[s["step"]]["time"] > end]
                other = [e["reason"] for e in events if e["event"] == "checkpoint" and e["reason"] not in ("interval", "limit")]
                rates[label].append({"samples_per_second": summary["samples_per_second"], "interval_saves": len(saves),
                                     "other_saves": other,
                                     "train_seconds": summary["train_seconds"],
                                     "write_seconds": [written[s["step"]]["write_seconds"] for s in saves
                                                       if s["step"] in written],
                                     "writes_finished_after_window": late})
                shutil.rmtree(run / "ckpt")  # ~1.1 GB per checkpoint: keep the disk and page cache the same for every run
    ratios = [b["samples_per_second"] / a["samples_per_second"] for a, b in zip(rates["none"], rates["every_30s"])]
    ratio = statistics.median(ratios)
    sync_med = statistics.median(blocked["sync"])
    async_med = statistics.median(blocked["async"])
    return {
        "benchmark": "checkpoint", "state_bytes": state_bytes, "processes": 2,
        "blocked_seconds": blocked, "blocked_median": {"sync": sync_med, "async": async_med},
        "throughput": rates, "throughput_ratios": [round(r, 4) for r in ratios],
        "all_interval_writes_inside_window": not any(r["writes_finished_after_window"] for r in rates["every_30s"]),
        "targets": {
            "async_blocked_vs_sync": target(round(async_med / sync_med, 4), 0.10),
            "samples_per_second_with_30s_checkpoints_vs_none": target(round(ratio, 4), 0.97, lower_is_better=False),
        },
    }


def bench_recovery(*, trials: int = 5) -> dict:
    def edit(d):
        d["training"].update(model="mlp", hidden_size=256, micro_batch_size=32, global_batch_size=64,
                             processes_per_node=2, epochs=2, checkpoint={"every_steps": 5})

    seconds, restarts = [], []
    with tempfile.TemporaryDirectory(prefix="ballast-bench-recovery-") as tmp:
        root = Path(tmp)
        spec, cache = _prepare(root, rows=8_000, shape=(8, 8), edit=edit)
        for i in range(trials):
            run = root / f"trial-{i}"
            kill_step = 12 + i
            # A restarted gloo group sometimes fails to connect its full mesh (see ../shared/STACK.md); a short
            # distributed timeout turns a stuck attempt into a quick failure that torchrun restarts again.
            cfg = _config(spec, cache, run, {"rehearsal.faults": [{"kind": "crash", "step": kill_step, "rank": 1}],
                                             "distributed.timeout_seconds": 20})
            proc = _torchrun(cfg, extra=("--max-restarts=5",), timeout=600, preload=True)
            killed_at = float(next((run / "out").glob(".fault-crash-*")).read_text())
            first = [e for e in _events(run) if e["event"] == "first_step_after_resume"]
            seconds.append(first[0]["time"] - killed_at)
            restarts.append(proc.stderr.count("connectFullMesh failed"))
    med = statistics.median(seconds)
    return {
        "benchmark": "recovery", "trials": trials, "seconds": [round(s, 3) for s in seconds],
        "extra_failed_attempts_seen": restarts,
        "median": med, "min": min(seconds), "max": max(seconds),
        "stdev": statistics.stdev(seconds) if len(seconds) > 1 else 0.0,
        "note": "SIGKILL of rank 1; torchrun's agent (python -m ballast.training.torchrun: workers forked from a process "
                "that preloaded torch) with --monitor-interval=0.1 restarts the group; time to the first "
                "completed step after resuming from the latest committed checkpoint",
        "targets": {"median_seconds_kill_to_next_step": target(round(med, 3), 5.0)},
    }


def _free_port_block(n: int) -> int:
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65000:
            return base
    raise RuntimeError("no free port")

