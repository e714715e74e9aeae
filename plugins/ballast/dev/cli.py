"""`ballast` command line: lint and schema for spec authors, demo data, the local demo, benchmarks, planning,
rendering a try's cluster job."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ballast.errors import BallastError, SpecError


def cmd_lint(args: argparse.Namespace) -> int:
    from ballast.spec.loading import lint_spec

    failed = 0
    paths: list[Path] = []
    for name in args.files:
        p = Path(name)
        paths += sorted(p.glob("*.y*ml")) if p.is_dir() else [p]
    for path in paths:
        try:
            spec = lint_spec(path)  # the spec, and its model's options against the model's options_schema
        except SpecError as exc:
            failed += 1
            for line in exc.problems:
                print(line)
            continue
        except Exception as exc:  # no check anticipated it: still one line for this spec, and lint goes on
            failed += 1
            detail = " ".join(str(exc).split())[:300]
            print(f"{path}: cannot read spec: {type(exc).__name__}: {detail}")
            continue
        if not args.quiet:
            print(f"{path}: ok ({spec.dag_id})")
    return 1 if failed else 0


def cmd_schema(args: argparse.Namespace) -> int:
    from ballast.spec import json_schema

    text = json.dumps(json_schema(), indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from ballast.data import demo
    from ballast.storage import resolve_local

    dest = resolve_local(args.dest or f"raw/{args.name or args.kind}")
    if args.kind == "digits":
        print(demo.write_digits(dest))
    elif args.kind == "synthetic":
        for p in demo.write_synthetic(dest, rows=args.rows or 100_000, seed=args.seed):
            print(p)
    elif args.kind == "corpus":
        print(demo.write_corpus(dest, max_mb=args.max_mb, repeat=args.repeat))
    elif args.kind == "segmentation":
        print(demo.write_segmentation(dest, rows=args.rows or 512, size=args.size or 32, three_d=args.three_d,
                                      dtype=args.dtype, seed=args.seed))
    else:
        print(demo.write_regression(dest, rows=args.rows or 512, size=args.size or 16, seed=args.seed))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ballast.dev.dag_run import run_demo

    return run_demo(spec_name=args.spec, conf=dict(kv.split("=", 1) for kv in args.conf), verbose=args.verbose)


def cmd_ui(args: argparse.Namespace) -> int:
    from ballast.dev.stack import serve

    return serve(args.port)


def cmd_bench(args: argparse.Namespace) -> int:
    from ballast.bench import run_benchmark

    result = run_benchmark(args.name, args)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from ballast.dev.scale_plan import run

    return run(args)


def cmd_render(args: argparse.Namespace) -> int:
    from ballast.launch.preview import render
    from ballast.spec import load_spec

    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # the provider's pod builder logs to stdout: keep it YAML
        text = render(load_spec(args.spec), try_number=args.try_number, after=args.after)
    print(text, end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ballast", description="Declarative training pipelines on Airflow 3.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("lint", help="check spec files; one line per problem, non-zero exit on any")
    s.add_argument("files", nargs="+", help="spec files or directories of specs")
    s.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    s.set_defaults(fn=cmd_lint)

    s = sub.add_parser("schema", help="print the spec's JSON Schema (for editors)")
    s.add_argument("-o", "--output", help="write to this file instead of stdout")
    s.set_defaults(fn=cmd_schema)

    s = sub.add_parser("data", help="write demo or synthetic raw data under BALLAST_HOME/raw/<name>")
    s.add_argument("kind", choices=["digits", "synthetic", "corpus", "segmentation", "regression"],
                   help="digits; synthetic (classification); corpus (the Python standard library's sources, one"
                        " document per file); segmentation (shapes and masks; --3d for volumes); regression"
                        " (a disc's area)")
    s.add_argument("--dest", help="directory (default BALLAST_HOME/raw/<name>)")
    s.add_argument("--name", help="directory name under BALLAST_HOME/raw (default: the kind)")
    s.add_argument("--rows", type=int, help="rows (synthetic: 100000, segmentation and regression: 512)")
    s.add_argument("--size", type=int, help="segmentation: image side (32); regression: 16")
    s.add_argument("--3d", dest="three_d", action="store_true", help="segmentation: 3-D volumes [16, size, size]")
    s.add_argument("--dtype", choices=["float32", "uint8"], default="float32", help="segmentation: image type")
    s.add_argument("--max-mb", type=float, help="corpus: at most this many MB of text (default: all of it)")
    s.add_argument("--repeat", type=int, default=1, help="corpus: write the documents this many times")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_data)

    s = sub.add_parser("demo", help="run an example pipeline end to end through Airflow (dag.test)")
    s.add_argument("--spec", default="digits", help="spec name in dags/specs (default digits)")
    s.add_argument("--conf", nargs="*", default=[], metavar="KEY=VALUE", help="run parameters")
    s.add_argument("--verbose", action="store_true", help="Airflow's full log on the console instead of a file")
    s.set_defaults(fn=cmd_demo)

    s = sub.add_parser("ui", help="run the Airflow API server (UI), scheduler and DAG processor locally")
    s.add_argument("--port", type=int, default=8080)
    s.set_defaults(fn=cmd_ui)

    s = sub.add_parser("bench", help="run a benchmark and write its JSON")
    s.add_argument("name", choices=["parse", "overhead", "checkpoint", "recovery", "goodput", "convert", "read",
                                           "warmup", "lm", "sharded-checkpoint", "scale", "view"])
    s.add_argument("--rows", type=int, help="convert, warmup, scale: rows of synthetic data (convert, scale: 1x)")
    s.add_argument("--samples", type=int, help="read: number of samples")
    s.add_argument("--specs", type=int, default=50, help="parse: number of generated specs")
    s.add_argument("--repeat", type=int, default=3, help="parse: timed repetitions (median reported)")
    s.add_argument("--mtbf", type=float, help="goodput: mean seconds between random rank kills (default 60)")
    s.add_argument("--epochs", type=int, help="goodput: epochs of the digits training (default 300, ~85 s here)")
    s.add_argument("--small", action="store_true", help="sharded-checkpoint: a tiny model on 2 ranks (a shape check)")
    s.add_argument("--device", choices=["cpu", "cuda"], help="sharded-checkpoint: cuda runs one rank per GPU on NCCL")
    s.add_argument("--json", help="write the result JSON here")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("render", help="print what a try submits: Kubernetes manifests, a Slurm job, a torchrun argv")
    s.add_argument("spec", help="spec file")
    s.add_argument("--try", dest="try_number", type=int, default=1, help="the try number (default 1)")
    s.add_argument("--after", nargs="*", default=[], metavar="CLASS[@HOST]",
                   help="earlier tries' failures, oldest first (preempted, hang@node-7, oom): their adaptations show")
    s.set_defaults(fn=cmd_render)

    s = sub.add_parser("plan", help="predict failures, goodput and the best checkpoint interval at N GPUs")
    s.add_argument("spec", help="spec file")
    s.add_argument("--gpus", type=int, required=True, help="GPUs the job would run on")
    s.add_argument("--mttf-hours", type=float, help="job MTTF at --gpus (default: the Meta RSC power law)")
    s.add_argument("--mttf-reference", action="append", default=[], metavar="HOURS@GPUS",
                   help="measured MTTF points to fit the power law through (repeatable)")
    s.add_argument("--save-seconds", type=float, help="training time one checkpoint save blocks")
    s.add_argument("--restart-seconds", type=float, help="detection + relaunch + load + first step")
    s.add_argument("--from-run", help="measured costs: a run report JSON (or its run directory)")
    s.add_argument("--step-seconds", type=float, help="seconds per optimizer step, to count checkpoint.every_steps")
    s.add_argument("--hours", type=float, default=24.0, help="run length for the retry-exhaustion odds (default 24)")
    s.add_argument("--json", help="write the figures here")
    s.set_defaults(fn=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except BallastError as exc:
        print(f"ballast {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
