"""The spec's `notifications` section: who hears of a failed or retried task, and through which
Airflow connection (a webhook through an HTTP connection, email through an SMTP connection)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from ballast.training.config.sections import Section

CONN_ID = r"[A-Za-z0-9_.\-]{1,250}"
EMAIL = r"[^@\s,;<>]+@[^@\s,;<>]+\.[^@\s,;<>]+"


class WebhookSpec(Section):
    conn_id: str = Field(pattern=CONN_ID)
    """Airflow HTTP connection holding the base URL (and any credentials) of the webhook."""
    endpoint: str = ""
    """Path after the connection's base URL (e.g. /hooks/ballast)."""

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if re.search(r"\s|://", v):
            raise ValueError(f"{v!r} is not a path (the host and scheme belong in the connection)")
        return v


class EmailSpec(Section):
    to: tuple[str, ...] = Field(min_length=1)
    """Recipients."""
    conn_id: str = Field("smtp_default", pattern=CONN_ID)
    """Airflow SMTP connection (the SMTP provider's)."""

    @field_validator("to")
    @classmethod
    def _addresses(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for addr in v:
            if not re.fullmatch(EMAIL, addr):
                raise ValueError(f"{addr!r} is not an email address")
        return v


class NotificationsSpec(Section):
    on: tuple[Literal["failure", "retry"], ...] = ("failure", "retry")
    """When to notify: a task that failed for good, a try that failed and will be retried."""
    webhook: WebhookSpec | None = None
    """POST a JSON message (failure class, adaptation, a link to the stability view) to a webhook."""
    email: EmailSpec | None = None
    """Send the same message by email."""

    @property
    def enabled(self) -> bool:
        return bool(self.on) and (self.webhook is not None or self.email is not None)
