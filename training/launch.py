"""torchrun with the trainer preloaded: `python -m training.launch [torchrun options] --module training --config F`.

Same options, rendezvous and restart policy as `torchrun` (torch.distributed.run's own parser and
elastic agent), but workers are forked from a forkserver that imported torch and the trainer once.
A plain torchrun starts every worker, and every restarted worker, as a fresh interpreter that imports
torch again: seconds of a group restart on a busy machine. Here a restart forks a warm process.
"""

from __future__ import annotations

import multiprocessing
import sys
import uuid


def worker(*argv: str) -> None:
    """One rank: what `python -m training --config F` does, inside a forked worker."""
    from training.__main__ import main

    code = main(list(argv))
    if code:
        sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

    args = get_args_parser().parse_args(argv if argv is not None else sys.argv[1:])
    if args.training_script != "training":
        raise SystemExit("training.launch runs the trainer only: pass --module training --config FILE")
    # As torch.distributed.run.run() does before building the config.
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and parse_min_max_nnodes(args.nnodes)[1] == 1):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    multiprocessing.set_forkserver_preload(["training.worker_preload"])
    try:
        elastic_launch(config=config, entrypoint=worker)(*args.training_script_args)
    except ChildFailedError as exc:  # as torchrun: a summary of the failed ranks, exit 1
        print(exc.format_msg(), file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
