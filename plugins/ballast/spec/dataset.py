"""The spec's `dataset` section: where the raw data is, its schema, and how rows are split."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ballast.training.config.sections import NumClasses, Section, Seed, Shape

FieldType = Literal["float32", "float64", "int32", "int64", "uint8", "bool", "string"]


class FieldSpec(Section):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Column name in the raw data."""
    type: FieldType
    """Element type. Array fields are stored flattened, row-major."""
    shape: Shape = ()
    """Shape of one value; `[]` for a scalar, e.g. `[8, 8]` for an 8x8 image. At most 8 dimensions and
    2^31 elements."""
    codec: Literal["auto", "png", "jpeg", "ndarray"] = "auto"
    """How the Petastorm dataset stores an array field: `png` or `jpeg` (compressed images; uint8 of
    shape [H, W] or [H, W, 3]), `ndarray` (numpy bytes, any type). `auto`: png for uint8 images,
    ndarray otherwise. Scalars are stored as plain Parquet columns."""

    @model_validator(mode="after")
    def _check_codec(self) -> FieldSpec:
        if self.codec in ("png", "jpeg"):
            image = len(self.shape) == 2 or (len(self.shape) == 3 and self.shape[2] in (1, 3))
            if self.type != "uint8" or not image:
                raise ValueError(f"codec: {self.codec} stores uint8 images of shape [H, W] or [H, W, 3]"
                                 f" (got {self.type} {list(self.shape)}); use codec: ndarray")
        elif self.codec == "ndarray" and not self.shape:
            raise ValueError("codec: ndarray is for array fields; a scalar needs no codec")
        return self

    @property
    def storage_codec(self) -> str:
        """The codec actually used: scalar, png, jpeg or ndarray."""
        if not self.shape:
            return "scalar"
        if self.codec != "auto":
            return self.codec
        image = len(self.shape) == 2 or (len(self.shape) == 3 and self.shape[2] in (1, 3))
        return "png" if self.type == "uint8" and image else "ndarray"


class SplitSpec(Section):
    validation: float = Field(0.1, ge=0.0, lt=0.5)
    """Fraction of rows held out for per-epoch validation (early stopping)."""
    test: float = Field(0.1, gt=0.0, lt=0.5)
    """Fraction of rows held out for the final evaluation; never seen in training."""
    seed: Seed = 0
    """Seed of the deterministic row-to-split assignment (0 to 2^32 - 1)."""


class DatasetSpec(Section):
    location: str = Field(min_length=1)
    """Raw data: a Parquet file or directory of Parquet files; a path relative to BALLAST_HOME,
    an absolute path, or an s3:// URI read with the storage connection."""
    format: Literal["parquet"] = "parquet"
    """Format of the raw data."""
    fields: tuple[FieldSpec, ...] = Field(min_length=1)
    """Schema: every column the pipeline reads, with type and shape."""
    label: str
    """Name of the label column (an integer class id)."""
    num_classes: NumClasses
    """Number of classes; labels must lie in [0, num_classes)."""
    split: SplitSpec = SplitSpec()
    """How rows are divided into train, validation and test."""

    @model_validator(mode="after")
    def _check_fields(self) -> DatasetSpec:
        names = [f.name for f in self.fields]
        seen: set[str] = set()
        dupes: set[str] = set()
        for name in names:  # one pass: a spec may list many fields
            (dupes if name in seen else seen).add(name)
        if dupes:
            raise ValueError(f"fields: duplicate field name(s) {_listed(sorted(dupes))}")
        if self.label not in seen:
            raise ValueError(f"label: {self.label!r} is not one of the fields ({_listed(names)})")
        label = next(f for f in self.fields if f.name == self.label)
        if label.type not in ("int32", "int64", "uint8") or label.shape:
            raise ValueError(f"label: field {self.label!r} must be a scalar integer (got {label.type} {list(label.shape)})")
        if len(names) != 2:
            raise ValueError(f"fields: need exactly one feature field besides the label (got {len(names) - 1});"
                             " models with several inputs are not supported yet")
        return self

    @property
    def features(self) -> tuple[FieldSpec, ...]:
        return tuple(f for f in self.fields if f.name != self.label)


def _listed(names: list[str], limit: int = 10) -> str:
    """The first `limit` names, comma-separated, and how many more: a message stays one short line."""
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
