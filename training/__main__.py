"""Entry point: `torchrun ... -m training --config run.json`.

Exit codes follow training.failure.EXIT_CODES; on failure a failure.json record is written to the
run's output directory, unless nobody reads this process's output any more: its task has died, the
try is abandoned (its processes are being ended by their parent-death signals, training.launch), and
what fails now (a write to the broken log pipe, a peer rank already gone) is not this try's failure.
The next try would otherwise read it as one (a `communication` error, say) and adapt to it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ballast.training.failure import EXIT_CODES, TrainingFailure, classify, write_record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ballast.training", description=__doc__)
    parser.add_argument("--config", required=True, help="run config JSON written by the orchestrator")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    out_dir = None
    trainer = None
    try:
        from ballast.training.config import RunConfig

        cfg = RunConfig.load(args.config)
        out_dir = Path(cfg.output_dir)
        if cfg.resources.reuse_freed_memory:
            from ballast.training.hostmem import keep_freed_memory

            keep_freed_memory()
        from ballast.training.trainer import Trainer

        trainer = Trainer(cfg)
        trainer.run()
        trainer.dist.close()
        return 0
    except (Exception, KeyboardInterrupt) as exc:
        cls = classify(exc)
        from ballast.training.parentdeath import output_orphaned

        if output_orphaned():
            return EXIT_CODES[cls]  # no record, no message: nobody is left to read either
        step = trainer.step if trainer is not None else None
        if out_dir is not None:
            write_record(out_dir, exc, step=step, rank=rank)
        msg = str(exc) if isinstance(exc, TrainingFailure) else f"{type(exc).__name__}: {exc}"
        print(f"[train] rank {rank} failed ({cls}, exit {EXIT_CODES[cls]}): {msg}", file=sys.stderr, flush=True)
        if cls == "user_code":
            import traceback

            traceback.print_exc()
        return EXIT_CODES[cls]


if __name__ == "__main__":
    if os.environ.get("BALLAST_PARENT_PID"):  # started by the orchestrator itself, without the launcher
        import signal

        from ballast.training.parentdeath import die_with_parent

        die_with_parent(signal.SIGKILL, int(os.environ.pop("BALLAST_PARENT_PID")))
    sys.exit(main())
