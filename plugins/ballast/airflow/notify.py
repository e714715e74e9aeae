"""Failure and retry notifications: an Airflow notifier (`airflow.sdk.BaseNotifier`) on every stage's
`on_failure_callback` and `on_retry_callback` when the spec's `notifications` section names a channel.

The message says what failed and what happens next: the stage, the try, the failure class (the same
one the recovery policy keys on), its reason in one line, the adaptation the next try of `train` will
make (`ballast.recovery.adapt`: a smaller micro-batch, the on-demand pool, hosts to avoid), and a link
to the run's "Training stability" tab. It goes out through the providers' own hooks: a JSON POST
through an HTTP connection (`HttpHook`), email through an SMTP connection (the SMTP provider's
`SmtpNotifier`). A channel that cannot deliver (a missing or malformed connection, a server that
refuses) writes one error line to the task log and never changes the task's outcome.
"""

from __future__ import annotations

import html
import logging
from typing import Any
from urllib.parse import quote

from airflow.sdk import BaseNotifier

log = logging.getLogger("ballast.airflow.notify")


class StageNotifier(BaseNotifier):
    template_fields = ()  # nothing in a spec is a template

    def __init__(self, *, event: str, stage: str, spec_data: dict, spec_file: str):
        super().__init__()
        self.event, self.stage, self.spec_data, self.spec_file = event, stage, spec_data, spec_file

    def notify(self, context: Any) -> None:
        from ballast.spec import parse_spec

        try:
            spec = parse_spec(self.spec_data, source=self.spec_file)
            message = compose(spec, self.event, self.stage, context)
        except Exception as exc:  # noqa: BLE001  (as in _deliver: one line, the task's outcome unchanged)
            log.error("notification of %s on %s not composed: %s: %s", self.event, self.stage, type(exc).__name__,
                      " ".join(str(exc).split())[:500])
            return
        channels = spec.notifications
        if channels.webhook is not None:
            _deliver("webhook", channels.webhook.conn_id, lambda: _post(channels.webhook, message))
        if channels.email is not None:
            _deliver("email", channels.email.conn_id, lambda: _mail(channels.email, message, context))


def compose(spec, event: str, stage: str, context: Any) -> dict[str, Any]:
    """The message: JSON-ready, the same for every channel."""
    from ballast.errors import failure_class

    ti = context["ti"]
    dag_id, run_id = ti.dag_id, context["run_id"]
    exc = context.get("exception")
    cls = failure_class(_ballast_cause(exc)) if isinstance(exc, BaseException) else None
    reason = _redact(" ".join(str(exc).split())[:2000]) if exc is not None else None
    adaptation = _next_adaptation(spec, dag_id, run_id, ti.task_id) if event == "retry" and stage == "train" else []
    return {
        "event": event, "pipeline": spec.name, "dag_id": dag_id, "run_id": run_id, "task_id": ti.task_id,
        "stage": stage, "try_number": ti.try_number, "max_tries": getattr(ti, "max_tries", None),
        "failure_class": cls, "reason": reason, "adaptation": adaptation, "view": view_url(dag_id, run_id),
    }


def _redact(text: str) -> str:
    """What Airflow masks in logs (connection passwords, secret variables) masked here too: the message
    leaves Airflow."""
    try:
        from airflow.sdk.log import redact
    except ImportError:  # pragma: no cover
        return text
    return str(redact(text))


def _ballast_cause(exc: BaseException) -> BaseException:
    """The Ballast error under Airflow's wrapper (a no-retry failure is re-raised as AirflowFailException)."""
    from ballast.errors import BallastError

    seen = exc
    while not isinstance(seen, BallastError) and (seen.__cause__ or seen.__context__) is not None:
        seen = seen.__cause__ or seen.__context__
    return seen if isinstance(seen, BallastError) else exc


def view_url(dag_id: str, run_id: str) -> str:
    """The run's "Training stability" tab in the Airflow UI ([api] base_url)."""
    from airflow.configuration import conf

    base = conf.get("api", "base_url", fallback="http://localhost:8080/").rstrip("/")
    return f"{base}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}/plugin/ballast-run"


def _next_adaptation(spec, dag_id: str, run_id: str, task_id: str) -> list[str]:
    """What the next try of this train task will change, from its attempt history (as it will decide)."""
    from ballast.pipeline.context import RunContext
    from ballast.recovery import adapt, history

    try:
        attempts = history.load(RunContext(spec=spec, dag_id=dag_id, run_id=run_id), task_id).attempts
        return adapt.next_settings(spec, attempts)[1]
    except Exception as exc:  # noqa: BLE001  (the message goes out without it)
        log.warning("notification: the next try's adaptation is unknown (%s)", exc)
        return []


def _deliver(channel: str, conn_id: str, send) -> None:
    try:
        send()
    except Exception as exc:  # noqa: BLE001  (a notification never fails the task it reports on)
        text = " ".join(str(exc).split())[:500] or type(exc).__name__
        log.error("notification by %s through connection %r failed: %s: %s (fix the connection; the task's"
                  " outcome is unchanged)", channel, conn_id, type(exc).__name__, text)
    else:
        log.info("notification sent by %s through connection %r", channel, conn_id)


def _post(webhook, message: dict) -> None:
    from airflow.providers.http.hooks.http import HttpHook

    HttpHook(method="POST", http_conn_id=webhook.conn_id).run(
        endpoint=webhook.endpoint, json=message, extra_options={"timeout": 10})


def _mail(email, message: dict, context: Any) -> None:
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier

    SmtpNotifier(to=list(email.to), smtp_conn_id=email.conn_id, subject=subject(message),
                 html_content=html_body(message)).notify(context)


def subject(message: dict) -> str:
    what = "will be retried" if message["event"] == "retry" else "failed"
    cls = f" ({message['failure_class']})" if message["failure_class"] else ""
    return f"[Ballast] {message['pipeline']}: {message['task_id']} try {message['try_number']} {what}{cls}"


def html_body(message: dict) -> str:
    rows = "".join(f"<tr><th align=left>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in message.items() if k not in ("adaptation", "view") and v is not None)
    adapt = "".join(f"<li>{html.escape(a)}</li>" for a in message["adaptation"])
    return (f"<p>{html.escape(subject(message))}</p><table>{rows}</table>"
            + (f"<p>The next try:</p><ul>{adapt}</ul>" if adapt else "")
            + f'<p><a href="{html.escape(message["view"])}">Training stability</a></p>')


def callbacks(notifications: dict, stage: str, spec_data: dict, spec_file: str) -> dict[str, list]:
    """The operator's callback arguments for a stage (none when the spec names no channel)."""
    from ballast.spec.notifications import NotificationsSpec

    n = NotificationsSpec.model_validate(notifications or {})
    if not n.enabled:
        return {}
    out: dict[str, list] = {}
    for event, arg in (("failure", "on_failure_callback"), ("retry", "on_retry_callback")):
        if event in n.on:
            out[arg] = [StageNotifier(event=event, stage=stage, spec_data=spec_data, spec_file=spec_file)]
    return out
