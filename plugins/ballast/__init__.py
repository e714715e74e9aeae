"""Ballast: declarative training pipelines on Apache Airflow 3.

Layers: `ballast.spec` (YAML -> typed model), `ballast.pipeline.plan` (model -> plain stage data),
`ballast.airflow.dags` (plan -> Airflow DAG; the only module importing airflow.sdk at parse time) and
`ballast.stages.*` (what each task does at run time; heavy imports live inside them).
"""

__version__ = "0.1.0"
