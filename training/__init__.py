"""What runs inside a training process or pod.

Never imports Airflow (or `ballast`): the contract with the orchestrator is a run config (JSON) in,
and files (checkpoints, metrics, a failure record) plus an exit code out. See `training.failure`.
Importing this package is cheap: torch is imported only by the modules that train.
"""
