"""The Airflow plugin: the stability view's app mounted on the API server at /ballast, a "Training
stability" tab on every DAG run, and a "Ballast pipelines" entry in the navigation (Browse).

Registered through the `airflow.plugins` entry point (pyproject.toml), so `airflow plugins` lists it
wherever the package is installed. Every Airflow process loads plugins (the scheduler, each task's
runner); the app behind the mount is imported on its first request, so they never import it.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

PREFIX = "/ballast"


class LazyApp:
    """An ASGI app that imports `ballast.ui.app` on its first request."""

    def __init__(self) -> None:
        self._app = None

    async def __call__(self, scope, receive, send) -> None:
        if self._app is None:
            from ballast.ui.app import app

            self._app = app
        await self._app(scope, receive, send)


class BallastPlugin(AirflowPlugin):
    name = "ballast"
    fastapi_apps = [{"app": LazyApp(), "url_prefix": PREFIX, "name": "Ballast training stability"}]
    external_views = [
        {"name": "Training stability", "href": PREFIX + "/runs/{DAG_ID}/{RUN_ID}", "url_route": "ballast-run",
         "destination": "dag_run"},
        {"name": "Ballast pipelines", "href": PREFIX + "/", "url_route": "ballast", "destination": "nav",
         "category": "browse"},
    ]
