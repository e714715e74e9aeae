"""Training settings, defined once: the run config and the sections the spec shares with it.

`training.config.sections` holds the sections a spec is built from (defaults, bounds, docstrings,
checks; `training.config.rehearsal` the rehearsal's faults and budgets), `training.config.run` the `RunConfig` a training process loads and its own sections,
`training.config.messages` the one-line rendering of validation problems. pydantic only: no torch, no
Airflow. `RunConfig` is imported on first use, so that the spec (at DAG-parse time) builds only the
sections it needs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RUN_CONFIG_VERSION", "RunConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ballast.training.config import run

        return getattr(run, name)
    raise AttributeError(f"module 'ballast.training.config' has no attribute {name!r}")
