"""The spec's `dataset` section: where the raw data is, its schema (feature fields, an optional label, or
a text column the pipeline tokenizes), and how rows are split. Which fields a task needs (a scalar
integer label for classification, ...) is checked where the task is known, in `spec.root`, from the
properties here: `features`, `label_field`, `text_field`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ballast.training.config.sections import NumClasses, Section, Seed, Shape

_INTEGER = ("int32", "int64", "uint8")
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


class TokenizerSpec(Section):
    """How `dataset.text` becomes token ids: `{kind: bytes}` (the built-in byte-level vocabulary: ids
    0-255 are the UTF-8 bytes, 256 is end-of-text) or `{file: KEY}` (a Hugging Face `tokenizers` JSON
    file: a key in the pipeline's storage, or a path, absolute or relative to BALLAST_HOME)."""

    kind: Literal["bytes", "file"] = "file"
    """`bytes` or `file` (implied by `file:`)."""
    file: str | None = Field(None, min_length=1)
    """The tokenizer JSON file (kind file)."""
    eot: str | None = Field(None, min_length=1)
    """The file tokenizer's end-of-text token, joining documents; default the first of
    `<|endoftext|>`, `</s>`, `<eos>`, `[SEP]` in its vocabulary."""

    @model_validator(mode="before")
    @classmethod
    def _kind_from_file(cls, data: object) -> object:
        if isinstance(data, dict) and "kind" not in data and "file" not in data:
            raise ValueError("give `kind: bytes` or `file: <tokenizer JSON in storage>`")
        return data

    @model_validator(mode="after")
    def _check(self) -> TokenizerSpec:
        if self.kind == "bytes" and (self.file is not None or self.eot is not None):
            raise ValueError("kind bytes takes no file or eot (the byte vocabulary's end-of-text is id 256)")
        if self.kind == "file" and self.file is None:
            raise ValueError("kind file needs `file: <tokenizer JSON in storage>`")
        return self


class DatasetSpec(Section):
    location: str = Field(min_length=1)
    """Raw data: a Parquet file or directory of Parquet files; a path relative to BALLAST_HOME,
    an absolute path, or an s3:// URI read with the storage connection."""
    format: Literal["parquet"] = "parquet"
    """Format of the raw data."""
    fields: tuple[FieldSpec, ...] = Field(min_length=1)
    """Schema: every column the pipeline reads, with type and shape."""
    label: str | None = None
    """Name of the label column: an integer class id (classification), an integer mask (segmentation), a
    float scalar or array (regression); none for a language model."""
    num_classes: NumClasses | None = None
    """Number of classes (classification, segmentation); integer labels must lie in [0, num_classes)."""
    text: str | None = None
    """A language model's raw text column (a `string` field): the pipeline tokenizes it (`tokenizer`),
    joins the documents of each split with end-of-text and cuts `training.seq_len + 1` token sequences."""
    tokenizer: TokenizerSpec | None = None
    """How `text` is tokenized; default `{kind: bytes}`."""
    split: SplitSpec = SplitSpec()
    """How rows are divided into train, validation and test (a text dataset: documents)."""

    @model_validator(mode="after")
    def _check_fields(self) -> DatasetSpec:
        names = [f.name for f in self.fields]
        seen: set[str] = set()
        dupes: set[str] = set()
        for name in names:  # one pass: a spec may list many fields
            (dupes if name in seen else seen).add(name)
        if dupes:
            raise ValueError(f"fields: duplicate field name(s) {_listed(sorted(dupes))}")
        if self.label is not None and self.label not in seen:
            raise ValueError(f"label: {self.label!r} is not one of the fields ({_listed(names)})")
        label = self.label_field
        if label is not None and label.type == "string":
            raise ValueError(f"label: field {self.label!r} is a string; a label is a number or an array of numbers")
        if label is not None and self.num_classes is not None and label.type not in _INTEGER:
            kind = "an integer array" if label.shape else "a scalar integer"
            raise ValueError(f"label: field {self.label!r} must be {kind} (got {label.type} {list(label.shape)})")
        if self.text is not None:
            if self.text not in seen:
                raise ValueError(f"text: {self.text!r} is not one of the fields ({_listed(names)})")
            field = self.text_field
            if field.type != "string" or field.shape:
                raise ValueError(f"text: field {self.text!r} must be a scalar string (got {field.type}"
                                 f" {list(field.shape)}); the pipeline tokenizes it")
            if self.text == self.label:
                raise ValueError(f"text: {self.text!r} is the label too; a language model has no label")
        elif self.tokenizer is not None:
            raise ValueError("tokenizer: only a text dataset is tokenized; name its text column in `text`")
        strings = [f.name for f in self.features if f.type == "string"]
        if strings:
            raise ValueError(f"fields: string field(s) {_listed(strings)}: the only string column the pipeline reads"
                             f" is the text it tokenizes; name it in dataset.text, or give the field a numeric type")
        if self.text is None and not self.features:
            raise ValueError(f"fields: no feature field besides the label {self.label!r}; add the model's input")
        return self

    @property
    def features(self) -> tuple[FieldSpec, ...]:
        """The model's inputs: every field but the label and the text column."""
        return tuple(f for f in self.fields if f.name not in (self.label, self.text))

    @property
    def label_field(self) -> FieldSpec | None:
        return next((f for f in self.fields if f.name == self.label), None) if self.label else None

    @property
    def text_field(self) -> FieldSpec | None:
        return next((f for f in self.fields if f.name == self.text), None) if self.text else None

    @property
    def tokenizer_spec(self) -> TokenizerSpec:
        """The tokenizer of a text dataset: the spec's, or the byte vocabulary."""
        return self.tokenizer or TokenizerSpec(kind="bytes")


def _listed(names: list[str], limit: int = 10) -> str:
    """The first `limit` names, comma-separated, and how many more: a message stays one short line."""
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
