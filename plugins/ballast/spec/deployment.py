"""The spec's `schedule` and `storage` sections: when it runs and where its data lives (where it trains:
`ballast.spec.execution`)."""

from __future__ import annotations

import datetime as dt
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ballast.training.config.sections import Section


class ScheduleSpec(Section):
    cron: str | None = None
    """Cron expression or preset (@daily) for periodic retraining."""
    asset: str | None = None
    """Asset URI (e.g. s3://bucket/raw/digits): retrain when a producer updates it."""
    start_date: dt.date = dt.date(2026, 1, 1)
    """First logical date."""
    catchup: bool = False
    """Run the intervals missed since start_date."""

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, v: str | None) -> str | None:
        if v is None:
            return v
        presets = {"@once", "@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@annually"}
        if v.startswith("@"):
            if v not in presets:
                raise ValueError(f"unknown preset {v!r}; use one of {', '.join(sorted(presets))}")
            return v
        parts = v.split()
        if len(parts) != 5 or not all(re.fullmatch(r"[0-9*/,\-A-Za-z?LW#]+", p) for p in parts):
            raise ValueError(f"not a 5-field cron expression: {v!r} (e.g. '0 3 * * 1')")
        return v

    @model_validator(mode="after")
    def _one_trigger(self) -> ScheduleSpec:
        if self.cron and self.asset:
            raise ValueError("set cron or asset, not both")
        return self


class StorageSpec(Section):
    uri: str = "storage"
    """Where datasets, checkpoints and models live: a path (relative to BALLAST_HOME) or s3://bucket/prefix."""
    conn_id: str | None = None
    """Airflow connection with S3 credentials and endpoint; default: the standard AWS environment."""
    retry_mode: Literal["standard", "adaptive", "legacy"] = "adaptive"
    """botocore retry mode for S3 calls (adaptive adds client-side rate limiting on throttling)."""
    max_attempts: int = Field(8, ge=1, le=50)
    """Attempts per S3 call, the first included."""
    multipart_chunk_mb: int = Field(16, ge=5, le=5120)
    """Part size of multipart uploads and downloads (boto3's transfer manager); files above it go in parts."""
    transfer_concurrency: int = Field(8, ge=1, le=64)
    """Parallel parts per multipart transfer."""

    @field_validator("uri")
    @classmethod
    def _valid_uri(cls, v: str) -> str:
        if "://" in v and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?", v):
            raise ValueError(f"must be a local path or s3://bucket/prefix (got {v!r})")
        return v
