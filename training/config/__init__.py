"""Training settings, defined once: the run config and the sections the spec shares with it.

`training.config.sections` holds the sections (defaults, bounds, docstrings, checks),
`training.config.run` the `RunConfig` a training process loads, `training.config.messages` the
one-line rendering of validation problems. pydantic only: cheap to import, no torch, no Airflow.
"""

from training.config.run import RUN_CONFIG_VERSION, RunConfig

__all__ = ["RUN_CONFIG_VERSION", "RunConfig"]
