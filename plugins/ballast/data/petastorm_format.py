"""Petastorm's dataset format, written without Petastorm.

A Petastorm dataset is Parquet files plus `_common_metadata`, a Parquet metadata file whose key
`dataset-toolkit.unischema.v1` holds a pickled `petastorm.unischema.Unischema` (and whose key
`dataset-toolkit.num_row_groups_per_file.v1` holds the row groups of each file, as JSON). Users read
Ballast's datasets with `petastorm.make_reader` / `make_batch_reader` in environments of their own;
Ballast itself needs only the format, not Petastorm's code (which pins pyarrow < 15 and NumPy < 2).

So the pickle is written here, opcode by opcode (protocol 2), from plain data: the object it
describes is the one `materialize_dataset` pickles, `Unischema(name, [UnischemaField(name, numpy
type, shape, codec, nullable), ...])` with the codecs `NdarrayCodec()`, `CompressedImageCodec(png |
jpeg)` and `ScalarCodec(<pyspark.sql.types type>())`. Every global it names comes from the fixed
tables below, every string is length-prefixed UTF-8, so nothing from a spec or the data can become
pickle syntax. Ballast never unpickles anything; tests/test_readers.py has Petastorm 0.13.1 read the
datasets back in its own environment.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

UNISCHEMA_KEY = b"dataset-toolkit.unischema.v1"
ROW_GROUPS_PER_FILE_KEY = b"dataset-toolkit.num_row_groups_per_file.v1"

# numpy scalar type name -> the pyspark type petastorm's ScalarCodec stores it as.
SCALAR_SPARK_TYPES = {"int8": "ByteType", "int16": "ShortType", "int32": "IntegerType", "int64": "LongType",
                      "float32": "FloatType", "float64": "DoubleType", "bool_": "BooleanType"}
NUMPY_TYPES = frozenset({"uint8", "uint16", *SCALAR_SPARK_TYPES})
CODECS = {"ndarray": "NdarrayCodec", "png": "CompressedImageCodec", "jpeg": "CompressedImageCodec",
          "scalar": "ScalarCodec"}
# Names a Unischema answers itself: a field of one of these names is not set as an attribute (as
# petastorm's own constructor does not), or it would hide the method.
_UNISCHEMA_NAMES = frozenset({"create_schema_view", "fields", "as_spark_schema", "as_pyarrow_schema",
                              "make_namedtuple", "make_namedtuple_tf", "from_arrow_schema"})
JPEG_QUALITY = 80  # CompressedImageCodec's default


@dataclass(frozen=True)
class Field:
    """One column of a Petastorm dataset, as its UnischemaField says it."""

    name: str
    numpy_type: str
    """A NumPy scalar type's name (NUMPY_TYPES): `uint8`, `int64`, `float32`..."""
    shape: tuple[int | None, ...]
    codec: str
    """`ndarray`, `png`, `jpeg` (arrays) or `scalar` (shape ())."""
    nullable: bool = False

    def __post_init__(self) -> None:
        if self.numpy_type not in NUMPY_TYPES:
            raise ValueError(f"field {self.name!r}: numpy type {self.numpy_type!r} is not one of {sorted(NUMPY_TYPES)}")
        if self.codec not in CODECS:
            raise ValueError(f"field {self.name!r}: codec {self.codec!r} is not one of {sorted(CODECS)}")
        if (self.codec == "scalar") != (self.shape == ()):
            raise ValueError(f"field {self.name!r}: a scalar codec goes with shape () and only with it")
        if self.codec == "scalar" and self.numpy_type not in SCALAR_SPARK_TYPES:
            raise ValueError(f"field {self.name!r}: no Spark type for a scalar {self.numpy_type}")


class _Writer:
    """The few pickle opcodes a Unischema needs (protocol 2, no memo: every object written once)."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")  # PROTO 2

    def glob(self, module: str, name: str) -> None:
        self.out += b"c" + module.encode("ascii") + b"\n" + name.encode("ascii") + b"\n"  # GLOBAL

    def text(self, s: str) -> None:
        data = s.encode("utf-8")
        self.out += b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE

    def integer(self, i: int) -> None:
        self.out += b"J" + struct.pack("<i", i)  # BININT

    def value(self, v: object) -> None:
        if v is None:
            self.out += b"N"
        elif v is True or v is False:
            self.out += b"\x88" if v else b"\x89"
        elif isinstance(v, int):
            self.integer(v)
        elif isinstance(v, str):
            self.text(v)
        else:
            raise TypeError(f"no opcode here for {type(v).__name__}")

    def new(self, module: str, name: str) -> None:
        """`cls.__new__(cls)`: what copyreg writes for an object of a plain class."""
        self.glob(module, name)
        self.out += b")\x81"  # EMPTY_TUPLE NEWOBJ

    def build(self, state: dict[str, object]) -> None:
        """Set the object's __dict__ from `state` (values written by `value`)."""
        self.out += b"}("  # EMPTY_DICT MARK
        for key, v in state.items():
            self.text(key)
            self.value(v)
        self.out += b"ub"  # SETITEMS BUILD

    def codec(self, f: Field) -> None:
        name = CODECS[f.codec]
        self.new("petastorm.codecs", name)
        if f.codec in ("png", "jpeg"):
            self.build({"_image_codec": "." + f.codec, "_quality": JPEG_QUALITY})
        elif f.codec == "scalar":
            self.out += b"}"  # EMPTY_DICT
            self.text("_spark_type")
            self.new("pyspark.sql.types", SCALAR_SPARK_TYPES[f.numpy_type])
            self.out += b"sb"  # SETITEM BUILD

    def field(self, f: Field) -> None:
        self.glob("petastorm.unischema", "UnischemaField")
        self.out += b"("  # MARK: the namedtuple's values
        self.text(f.name)
        self.glob("numpy", f.numpy_type)
        self.out += b"("
        for d in f.shape:
            self.value(d)
        self.out += b"t"  # TUPLE
        self.codec(f)
        self.value(bool(f.nullable))
        self.out += b"t\x81"  # TUPLE NEWOBJ


def unischema_bytes(name: str, fields: list[Field]) -> bytes:
    """The pickle of `Unischema(name, fields)`, as `petastorm.etl.dataset_metadata` reads it."""
    names = [f.name for f in fields]
    if len(set(names)) != len(names):
        raise ValueError(f"field names repeat: {names}")
    w = _Writer()
    w.new("petastorm.unischema", "Unischema")
    w.out += b"}("  # the instance's __dict__
    w.text("_name")
    w.text(name)
    w.text("_fields")
    w.glob("collections", "OrderedDict")
    w.out += b")R("  # OrderedDict() then its items
    for f in fields:
        w.text(f.name)
        w.field(f)
    w.out += b"u"
    for f in fields:  # the constructor's attribute per field
        if not f.name.startswith("_") and f.name not in _UNISCHEMA_NAMES:
            w.text(f.name)
            w.field(f)
    w.out += b"ub."  # SETITEMS BUILD STOP
    return bytes(w.out)
