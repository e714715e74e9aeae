"""Every spec in dags/specs/ becomes one Ballast DAG (rendered for Airflow by plugins/ballast/airflow/dags.py)."""

from pathlib import Path

from ballast.airflow.dags import build_dags

globals().update(build_dags(Path(__file__).parent / "specs"))
