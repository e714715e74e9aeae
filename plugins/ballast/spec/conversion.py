"""The spec's `conversion` and `cache` sections: the packed formats, and the node-local cache's
warm-up phases (`cache.stages`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ballast.training.config.sections import MAX_SECONDS, DataFormat, Section

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
    """Rows read from the raw input at a time: bounds the arrow engine's memory."""

    @field_validator("formats")
    @classmethod
    def _unique_formats(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("list at least one format: petastorm, tfrecord")
        if len(set(v)) != len(v):
            raise ValueError(f"formats listed twice: {list(v)}")
        return v


class CacheStageSpec(Section):
    name: str = Field(pattern=NAME_PATTERN)
    """Stage name, shown in the task log."""
    fraction: float = Field(gt=0.0, le=1.0)
    """Cumulative fraction of the training shards cached once this stage is done."""


class CacheSpec(Section):
    directory: str | None = None
    """Node-local cache directory; default BALLAST_HOME/cache."""
    stages: tuple[CacheStageSpec, ...] = (
        CacheStageSpec(name="first_steps", fraction=0.25),
        CacheStageSpec(name="rest", fraction=1.0),
    )
    """Stages in order; the last must reach fraction 1.0. Validation and test shards come last."""
    max_bytes: int | None = Field(None, ge=1, le=2**63 - 1)
    """Byte budget of the cache; warming refuses to start a stage that would exceed it."""
    concurrency: int = Field(4, ge=1, le=64)
    """Parallel downloads."""
    wait_seconds: float = Field(3600.0, gt=0, le=MAX_SECONDS)
    """How long training waits for a shard that a later warm-up phase (cache.stages) has not brought yet."""

    @field_validator("stages")
    @classmethod
    def _stages_increase(cls, v: tuple[CacheStageSpec, ...]) -> tuple[CacheStageSpec, ...]:
        if not v:
            raise ValueError("list at least one stage")
        fractions = [s.fraction for s in v]
        if any(b <= a for a, b in zip(fractions, fractions[1:])):
            raise ValueError(f"stage fractions must increase (got {fractions})")
        if fractions[-1] != 1.0:
            raise ValueError(f"the last stage must have fraction 1.0 (got {fractions[-1]})")
        return v

