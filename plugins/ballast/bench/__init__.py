"""Benchmarks: `ballast bench NAME --json OUT`. Each returns a dict with a `targets` map.

`run_benchmark` imports the benchmark's module when it is asked for; what the modules share is in
`ballast.bench.measure`.
"""

from __future__ import annotations

import argparse
from typing import Any


def run_benchmark(name: str, args: argparse.Namespace) -> dict[str, Any]:
    if name == "parse":
        from ballast.bench.parse import bench_parse

        return bench_parse(specs=args.specs, repeat=args.repeat)
    if name in ("overhead", "checkpoint", "recovery"):
        from ballast.bench import train_runtime

        return getattr(train_runtime, f"bench_{name}")()
    if name == "goodput":
        from ballast.bench.goodput import bench_goodput

        given = {"mtbf": getattr(args, "mtbf", None), "epochs": getattr(args, "epochs", None)}
        return bench_goodput(**{k: v for k, v in given.items() if v is not None})
    if name == "lm":
        from ballast.bench.lm import bench_lm

        return bench_lm()
    if name in ("convert", "read", "warmup"):
        from ballast.bench import data_plane

        size = {"samples": args.samples} if name == "read" else {"rows": args.rows}
        return getattr(data_plane, f"bench_{name}")(**{k: v for k, v in size.items() if v is not None})
    if name == "sharded-checkpoint":
        from ballast.bench.sharded_checkpoint import bench_sharded_checkpoint

        return bench_sharded_checkpoint(small=getattr(args, "small", False), device=getattr(args, "device", None) or "cpu")
    if name == "scale":
        from ballast.bench.scale import bench_scale

        return bench_scale(**({"rows": args.rows} if getattr(args, "rows", None) else {}))
    if name == "view":
        from ballast.bench.view import bench_view

        return bench_view()
    raise ValueError(f"unknown benchmark {name!r}")

