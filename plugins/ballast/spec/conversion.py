"""The spec's `conversion` and `cache` sections: the packed formats, and the node-local cache's
warm-up phases (`cache.phases`; the old name `cache.stages` is still read, with a deprecation notice)."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ballast.training.config.sections import MAX_SECONDS, DataFormat, Section

log = logging.getLogger(__name__)

NAME_PATTERN = r"^[a-z][a-z0-9_]{0,62}$"


class ConversionSpec(Section):
    formats: tuple[DataFormat, ...] = ("petastorm", "tfrecord")
    """Packed formats to write: petastorm (Parquet readable by petastorm) and/or tfrecord."""
    shard_rows: int = Field(1000, ge=1, le=10_000_000)
    """Rows per output shard."""
    engine: Literal["arrow", "spark"] = "arrow"
    """Conversion engine: `arrow` streams in one process; `spark` runs the same conversion as a Spark
    job (`local[*]` here, or a cluster through `spark_master`). Both write the same rows and shards."""
    spark_master: str = "local[*]"
    """Spark master URL for the spark engine."""
    row_group_rows: int = Field(256, ge=1, le=1_000_000)
    """Rows per Parquet row group (the unit a Petastorm reader fetches)."""
    read_batch_rows: int = Field(4096, ge=1, le=1_000_000)
    """Rows read from the raw input at a time (fewer where rows are large: about 32 MiB decoded at a
    time), and rows validated at a time: bounds the arrow engine's memory."""

    @field_validator("formats")
    @classmethod
    def _unique_formats(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("list at least one format: petastorm, tfrecord")
        if len(set(v)) != len(v):
            raise ValueError(f"formats listed twice: {list(v)}")
        return v


class CachePhaseSpec(Section):
    name: str = Field(pattern=NAME_PATTERN)
    """Phase name, shown in the task log."""
    fraction: float = Field(gt=0.0, le=1.0)
    """Cumulative fraction of the training shards cached once this phase is done."""


class CacheSpec(Section):
    directory: str | None = None
    """Node-local cache directory; default BALLAST_HOME/cache."""
    phases: tuple[CachePhaseSpec, ...] = (
        CachePhaseSpec(name="first_steps", fraction=0.25),
        CachePhaseSpec(name="rest", fraction=1.0),
    )
    """Warm-up phases in order; the last must reach fraction 1.0. Validation and test shards come last."""
    max_bytes: int | None = Field(None, ge=1, le=2**63 - 1)
    """Byte budget of the cache; warming refuses to start a phase that would exceed it."""
    concurrency: int = Field(4, ge=1, le=64)
    """Parallel downloads."""
    wait_seconds: float = Field(3600.0, gt=0, le=MAX_SECONDS)
    """How long training waits for a shard that a later warm-up phase (cache.phases) has not brought yet."""

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data: Any) -> Any:
        """`cache.stages` was this field's name (a "stage" is a pipeline stage); it is still read."""
        if isinstance(data, dict) and "stages" in data:
            if "phases" in data:
                raise ValueError("give `phases` only (`stages` is its old name)")
            log.warning("cache.stages is deprecated: rename it to cache.phases (same entries)")
            data = {("phases" if k == "stages" else k): v for k, v in data.items()}
        return data

    @field_validator("phases")
    @classmethod
    def _phases_increase(cls, v: tuple[CachePhaseSpec, ...]) -> tuple[CachePhaseSpec, ...]:
        if not v:
            raise ValueError("list at least one phase")
        fractions = [s.fraction for s in v]
        if any(b <= a for a, b in zip(fractions, fractions[1:])):
            raise ValueError(f"phase fractions must increase (got {fractions})")
        if fractions[-1] != 1.0:
            raise ValueError(f"the last phase must have fraction 1.0 (got {fractions[-1]})")
        return v

