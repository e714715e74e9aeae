"""The spec's dataset section beyond one feature and a class label: several features, an optional label
of any numeric type and shape, a text column; each mistake one located line at lint time."""

from __future__ import annotations

import pytest
from ballast.errors import SpecError
from ballast.spec import parse_spec
from helpers import example_data

pytestmark = pytest.mark.unit


def _spec(edit):
    d = example_data()
    edit(d)
    return parse_spec(d)


def test_several_features_and_the_properties_the_task_checks_read():
    spec = _spec(lambda d: d["dataset"]["fields"].insert(1, {"name": "meta", "type": "int64", "shape": [3]}))
    ds = spec.dataset
    assert [f.name for f in ds.features] == ["image", "meta"]
    assert ds.label_field.name == "label" and ds.text_field is None and ds.tokenizer_spec.kind == "bytes"


@pytest.mark.parametrize("name,edit,message", [
    ("float_label_with_classes", lambda d: d["dataset"]["fields"][1].update(type="float32"),
     r"dataset\.label: field 'label' must be a scalar integer \(got float32 \[\]\)"),
    ("float_mask_with_classes", lambda d: d["dataset"]["fields"][1].update(type="float32", shape=[8, 8]),
     r"dataset\.label: field 'label' must be an integer array \(got float32 \[8, 8\]\)"),
    ("string_label", lambda d: (d["dataset"]["fields"][1].update(type="string"), d["dataset"].pop("num_classes")),
     r"dataset\.label: field 'label' is a string; a label is a number or an array of numbers"),
    ("only_the_label", lambda d: d["dataset"]["fields"].pop(0),
     r"dataset\.fields: no feature field besides the label 'label'; add the model's input"),
    ("string_feature", lambda d: d["dataset"]["fields"].append({"name": "note", "type": "string"}),
     r"dataset\.fields: string field\(s\) note: the only string column the pipeline reads is the text"),
    ("tokenizer_without_text", lambda d: d["dataset"].update(tokenizer={"kind": "bytes"}),
     r"dataset\.tokenizer: only a text dataset is tokenized; name its text column in `text`"),
    ("text_is_the_label", lambda d: d["dataset"].update(text="label"),
     r"dataset\.text: field 'label' must be a scalar string"),
])
def test_a_dataset_mistake_is_one_located_line(name, edit, message):
    with pytest.raises(SpecError, match=message) as info:
        _spec(edit)
    assert "\n" not in str(info.value), name
