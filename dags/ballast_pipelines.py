"""Every spec in dags/specs/ becomes one Ballast DAG (rendered for Airflow by plugins/ballast/render.py)."""

from pathlib import Path

from ballast.render import build_dags

globals().update(build_dags(Path(__file__).parent / "specs"))
