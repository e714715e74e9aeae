"""The packed dataset's format: the contract between conversion (which writes it) and the reader.

Both sides import this module, so the manifest's fields, the block list, the column layouts and the
bytes of every encoded value are defined once. numpy only at module level: the conversion stage runs
in the orchestrator's worker, and OpenCV and protobuf are imported where an image or a record is made.

A dataset has one or more columns, each a feature or the (optional) label, each an array or a scalar.
Layout of a converted dataset (see ballast.data.packing for how it is written):
    petastorm/<split>/part-NNNNN.parquet   Petastorm: every array column as its Petastorm codec writes
                                           it (`NdarrayCodec`: a whole .npy file; `CompressedImageCodec`:
                                           PNG or JPEG), every scalar a plain Parquet column (int64 for
                                           the integer types, float32, float64 or bool: `ScalarCodec`)
    tfrecord/<split>/part-NNNNN.tfrecord   tf.train.Example records, as TensorFlow parses them:
                                             <name>         arrays: bytes_list, the raw little-endian tensor
                                                            bytes (codec ndarray, no header) or the PNG/JPEG
                                                            file; integer and bool scalars: int64_list;
                                                            float32 scalars: float_list; float64 scalars:
                                                            bytes_list, the 8 raw bytes (a float_list would
                                                            round them)
                                             <name>/shape   int64_list: the value's shape, e.g. [8, 8] ([] for
                                                            a float64 scalar); arrays and float64 scalars
                                             <name>/dtype   bytes_list: its dtype name, e.g. b"float32"; the same
    manifest.json                          written last: `columns` (name, dtype, shape, codec, role), the
                                           task, num_classes, the tokenizer of a language-model dataset,
                                           every file with split, rows, bytes, sha256 and row groups

FORMAT_VERSION is part of the dataset id, so a change to these bytes never reuses an older conversion.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ballast.training.failure import DataFailure

FORMAT_VERSION = 4
"""4: several columns (features and an optional label of any type and shape), `columns` in the manifest
(3: one feature and a scalar integer label; TFRecord numeric features as raw tensor bytes)."""

IMAGE_CODECS = ("png", "jpeg")
ROLES = ("feature", "label")
_INTEGER = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


# --- the manifest ---------------------------------------------------------------------------------------


def read_manifest(data_dir: Path) -> dict:
    """The dataset's manifest.json, refused when missing, unreadable or of another format version."""
    path = Path(data_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except OSError as exc:
        raise DataFailure(f"{path}: dataset manifest missing; was the cache warmed?") from exc
    except ValueError as exc:
        raise DataFailure(f"{path}: dataset manifest is not valid JSON ({exc})") from exc
    version = manifest.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION or "columns" not in manifest:
        raise DataFailure(f"{path}: format_version {version}, this reader reads {FORMAT_VERSION}; convert the"
                          f" dataset again (a re-run of the convert stage writes the current format)")
    return manifest


@dataclass(frozen=True)
class Block:
    """The unit read at once: a Parquet row group, or a whole TFRecord shard."""

    path: str                # relative to the cache directory
    bytes: int               # the file's size per the manifest
    row_group: int | None    # Parquet row group, or None for a whole TFRecord file
    rows: int


def blocks_of(manifest: dict, split: str, fmt: str) -> list[Block]:
    """The blocks of one split in one format, in the manifest's file order."""
    out = []
    for e in manifest["files"]:
        if e["split"] != split or e["format"] != fmt or e.get("kind") == "metadata":
            continue
        if fmt == "petastorm":
            out.extend(Block(e["path"], e["bytes"], g, n) for g, n in enumerate(e["row_groups"]))
        else:
            out.append(Block(e["path"], e["bytes"], None, e["rows"]))
    return out


# --- the column layout ----------------------------------------------------------------------------------


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a spec field type (float32, uint8, bool, string, ...), little-endian: the byte
    order both the .npy files and the TFRecord tensors are written in, whatever the host's."""
    return np.dtype({"bool": "bool_", "string": "str_"}.get(name, name)).newbyteorder("<")


@dataclass(frozen=True)
class ColumnLayout:
    """What the manifest records of a column: enough to encode it and to decode it."""

    name: str
    dtype: str               # the spec's type name: float32, uint8, int32, ...
    shape: tuple[int, ...]   # of one value; () for a scalar
    codec: str               # ndarray, png, jpeg or scalar
    role: str = "feature"    # feature or label

    @classmethod
    def from_manifest(cls, entry: dict) -> ColumnLayout:
        return cls(entry["name"], entry["dtype"], tuple(entry["shape"]), entry["codec"], entry.get("role", "feature"))

    def to_manifest(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "codec": self.codec,
                "role": self.role}

    @property
    def numpy_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)

    @property
    def is_scalar(self) -> bool:
        return self.codec == "scalar"

    @property
    def is_integer(self) -> bool:
        return self.dtype in _INTEGER

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one raw value (codec ndarray)."""
        return self.numpy_dtype.itemsize * int(np.prod(self.shape))

    @property
    def stored_dtype(self) -> np.dtype:
        """What a scalar is stored as: int64 for every integer type, else its own type."""
        return np.dtype(np.int64) if self.is_integer else self.numpy_dtype

    @property
    def decoded_dtype(self) -> np.dtype:
        """What readers hand out: integer labels and integer features other than uint8 (token ids) as
        int64; float labels as float32; features of float, uint8 (pixels) and bool types as float32."""
        if self.is_integer and (self.role == "label" or self.dtype != "uint8"):
            return np.dtype(np.int64)
        return np.dtype(np.float32)


def columns_of(manifest: dict) -> tuple[list[ColumnLayout], ColumnLayout | None]:
    """(feature columns in order, the label column or None) of a manifest."""
    cols = [ColumnLayout.from_manifest(c) for c in manifest["columns"]]
    labels = [c for c in cols if c.role == "label"]
    return [c for c in cols if c.role == "feature"], (labels[0] if labels else None)


# --- the codecs: what Petastorm's codecs write, vectorised --------------------------------------------


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The bytes numpy's .npy format (so NdarrayCodec) puts before an array of this dtype and shape."""
    buf = io.BytesIO()
    np.save(buf, np.zeros(shape, dtype))
    raw = buf.getvalue()
    return raw[:len(raw) - dtype.itemsize * int(np.prod(shape))]


def encode_npy(layout: ColumnLayout, x: np.ndarray) -> np.ndarray:
    """(n, header + body) uint8: row i is the .npy file NdarrayCodec writes for x[i], without a loop."""
    n = len(x)
    header = npy_header(layout.numpy_dtype, layout.shape)
    body = np.ascontiguousarray(x, dtype=layout.numpy_dtype).reshape(n, -1).view(np.uint8)
    out = np.empty((n, len(header) + body.shape[1]), dtype=np.uint8)
    out[:, :len(header)] = np.frombuffer(header, dtype=np.uint8)
    out[:, len(header):] = body
    return out


def encode_images(layout: ColumnLayout, x: np.ndarray) -> list[bytes]:
    """PNG or JPEG files of uint8 images (n, H, W[, 3]), as CompressedImageCodec writes them (RGB in,
    OpenCV's BGR on disk, JPEG quality 95)."""
    import cv2

    ext = "." + layout.codec
    params = [int(cv2.IMWRITE_JPEG_QUALITY), 95] if layout.codec == "jpeg" else []
    values = []
    for img in x:
        if img.ndim == 3 and img.shape[2] == 3:
            img = cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
        ok, data = cv2.imencode(ext, img, params)
        if not ok:
            raise DataFailure(f"{layout.name}: OpenCV could not encode an image as {layout.codec}")
        values.append(data.tobytes())
    return values


def decode_tensors(layout: ColumnLayout, values: list[bytes] | np.ndarray | Any, where: str,
                   header: bytes = b"") -> np.ndarray:
    """decoded_dtype (n, *shape) from raw tensor bytes (header b"") or .npy files (header: the expected
    .npy header; values with another one, e.g. another byte order, go through numpy's own reader).
    `values` may be a (n, len(header) + tensor_bytes) uint8 matrix already (a block read at once)."""
    n = len(values)
    out = np.empty((n, *layout.shape), dtype=layout.decoded_dtype)
    size = len(header) + layout.tensor_bytes
    flat = values if isinstance(values, np.ndarray) else None
    if flat is None and n and all(len(v) == size for v in values):
        flat = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(n, size)
    if flat is not None and (flat[:, :len(header)] == np.frombuffer(header, dtype=np.uint8)).all():
        # One copy for the whole block: every value is header + raw body of the declared dtype.
        out[...] = np.ascontiguousarray(flat[:, len(header):]).view(layout.numpy_dtype).reshape(n, *layout.shape)
        return out
    if flat is not None:
        values = [bytes(row) for row in flat]
    for i, v in enumerate(values):
        if not header:
            raise DataFailure(f"{where}: row {i}: {layout.name!r} holds {len(v)} bytes, a {layout.dtype}"
                              f" {list(layout.shape)} tensor is {layout.tensor_bytes}; convert the dataset again")
        try:
            out[i] = np.load(io.BytesIO(v), allow_pickle=False).reshape(layout.shape)
        except Exception as exc:
            raise DataFailure(f"{where}: row {i}: {layout.name!r} is not a {list(layout.shape)} array ({exc})") from exc
    return out


def decode_images(layout: ColumnLayout, values: list[bytes] | Any, where: str) -> np.ndarray:
    """decoded_dtype (n, *shape) from PNG or JPEG files, RGB order as CompressedImageCodec returns them."""
    import cv2

    cv2.setNumThreads(1)  # one thread per loader worker; OpenCV's own pool would oversubscribe the cores
    out = np.empty((len(values), *layout.shape), dtype=layout.decoded_dtype)
    for i, v in enumerate(values):
        img = cv2.imdecode(np.frombuffer(v, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
        if img is None:
            raise DataFailure(f"{where}: row {i}: {layout.name!r} is not a decodable {layout.codec} image")
        if img.ndim == 3:
            img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        try:
            out[i] = img.reshape(layout.shape)
        except ValueError as exc:
            raise DataFailure(f"{where}: row {i}: image of shape {list(img.shape)}, expected"
                              f" {list(layout.shape)}") from exc
    return out


# --- TFRecord: tf.train.Example as TensorFlow parses it -------------------------------------------------


def shape_key(layout: ColumnLayout) -> str:
    return f"{layout.name}/shape"


def dtype_key(layout: ColumnLayout) -> str:
    return f"{layout.name}/dtype"


def tfrecord_kind(layout: ColumnLayout) -> str:
    """How a column is held in an Example: `bytes` (arrays, float64 scalars, with shape and dtype beside),
    `int` (integer and bool scalars) or `float` (float32 scalars)."""
    if not layout.is_scalar or layout.dtype == "float64":
        return "bytes"
    return "float" if layout.dtype == "float32" else "int"


def tfrecord_value(layout: ColumnLayout, encoded: bytes, header: bytes = b"") -> bytes:
    """The TFRecord bytes of one encoded array: an NdarrayCodec .npy file loses its header (`header`,
    from npy_header) so that tf.io.decode_raw reads exactly the tensor; images stay PNG/JPEG."""
    if layout.codec in IMAGE_CODECS:
        return encoded
    if not encoded.startswith(header) or len(encoded) != len(header) + layout.tensor_bytes:
        raise DataFailure(f"{layout.name}: an encoded value is not a {layout.dtype} {list(layout.shape)} .npy file")
    return encoded[len(header):]


def tfrecord_examples(layouts: list[ColumnLayout], columns: dict[str, list]) -> list[bytes]:
    """Serialised tf.train.Example records (the tfrecord package's protobuf classes), one per row of
    `columns` (name -> the row values: bytes for `bytes` columns, numbers otherwise), map keys sorted,
    so that the bytes depend only on the rows (protobuf's default map order does not)."""
    from tfrecord import example_pb2

    fixed: dict[str, Any] = {}
    for c in layouts:
        if tfrecord_kind(c) == "bytes":
            fixed[shape_key(c)] = example_pb2.Feature(int64_list=example_pb2.Int64List(value=list(c.shape)))
            fixed[dtype_key(c)] = example_pb2.Feature(bytes_list=example_pb2.BytesList(value=[c.dtype.encode()]))
    kinds = [(c.name, tfrecord_kind(c)) for c in layouts]
    n = len(columns[layouts[0].name]) if layouts else 0
    out = []
    for i in range(n):
        feature = dict(fixed)
        for name, kind in kinds:
            v = columns[name][i]
            if kind == "bytes":
                feature[name] = example_pb2.Feature(bytes_list=example_pb2.BytesList(value=[v]))
            elif kind == "int":
                feature[name] = example_pb2.Feature(int64_list=example_pb2.Int64List(value=[int(v)]))
            else:
                feature[name] = example_pb2.Feature(float_list=example_pb2.FloatList(value=[v]))
        example = example_pb2.Example(features=example_pb2.Features(feature=feature))
        out.append(example.SerializeToString(deterministic=True))
    return out


def tfrecord_description(layouts: list[ColumnLayout]) -> dict[str, str]:
    """What the reader asks the tfrecord package for: every column's value (shape and dtype are the
    manifest's; a value of another size is refused when decoded)."""
    return {c.name: {"bytes": "byte", "int": "int", "float": "float"}[tfrecord_kind(c)] for c in layouts}
