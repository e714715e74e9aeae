"""The base of every record: frozen, strict, self-describing; and the version a record carries."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """Frozen, unknown keys refused, the docstring under each field is its description."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def current_version(model: type[Record]) -> int:
    """The version of `model` this code writes and reads (its `version` field's default)."""
    return int(model.model_fields["version"].default)
