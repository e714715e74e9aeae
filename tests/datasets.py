"""Raw datasets of every kind the packed format holds, the specs that read them, and what conversion must
make of them: a text corpus (language model), several features with a float or array label
(regression, segmentation). Plain functions for the test modules (like helpers.py, imported after
conftest.py set the private homes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from ballast.data.packing import SPLITS, split_codes

BYTE_EOT = 256


def corpus_texts(n: int = 120, seed: int = 0) -> list[str]:
    """`n` distinct documents of varied length, ASCII and not (UTF-8 of 1 to 4 bytes a character)."""
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "naïve", "größe", "数据", "🙂", "lambda", "x", "import", "\n", "    "]
    return [f"doc {i}: " + " ".join(rng.choice(words, size=int(rng.integers(5, 80)))) for i in range(n)]


def write_texts(path: Path, texts: list[str | None], *, docs_per_group: int = 16) -> Path:
    """One raw Parquet file with a `text` column, `docs_per_group` documents a row group."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), path, row_group_size=docs_per_group)
    return path


def text_edit(location: Path, *, tokenizer: dict | None = None, seq_len: int = 16,
              rules: list[dict] | None = None) -> Callable[[dict], None]:
    """An edit of the example spec (helpers.make_ctx) into a language model on `location`'s text."""

    def edit(d: dict) -> None:
        d["dataset"] = {"location": str(location), "fields": [{"name": "text", "type": "string"}], "text": "text",
                        "tokenizer": tokenizer or {"kind": "bytes"}, "split": {"validation": 0.1, "test": 0.1, "seed": 3}}
        d["validation"] = {"rules": rules if rules is not None else [
            {"kind": "text_length", "field": "text", "min": 1, "max": 100_000},
            {"kind": "duplicate_share", "field": "text", "max": 0.1}]}
        d["conversion"]["shard_rows"] = 8
        d["training"].update(task="causal_lm", model={"name": "gpt", "options": {"layers": 1, "width": 32, "heads": 2}},
                             seq_len=seq_len)
        d["training"].pop("hidden_size", None)
        for key in ("metric", "mode", "threshold"):
            d["evaluation"].pop(key, None)

    return edit


def expected_sequences(texts: list[str], encode: Callable[[list[str]], list[list[int]]], *, seq_len: int,
                       eot: int, validation: float = 0.1, test: float = 0.1, seed: int = 3) -> dict[str, np.ndarray]:
    """What conversion must write, computed the plain way: each split's documents (by the row-id hash) in
    row order, joined with end-of-text, cut into seq_len + 1 token rows, the partial last row dropped."""
    codes = split_codes(np.arange(len(texts)), validation=validation, test=test, seed=seed)
    out = {}
    for k, split in enumerate(SPLITS):
        stream: list[int] = []
        for i, ids in enumerate(encode([t for t, c in zip(texts, codes) if c == k])):
            stream += ([eot] if i else []) + list(ids)
        rows = len(stream) // (seq_len + 1)
        out[split] = np.asarray(stream[:rows * (seq_len + 1)], np.int64).reshape(rows, seq_len + 1)
    return out


def utf8_ids(texts: list[str]) -> list[list[int]]:
    """The byte vocabulary, the plain way."""
    return [list(t.encode("utf-8")) for t in texts]


def train_tokenizer(texts: list[str], vocab_size: int = 300) -> Any:
    """A byte-level BPE tokenizer trained here with `tokenizers`, <|endoftext|> its special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


# --- several features, float and array labels -------------------------------------------------------------


def write_columns(path: Path, columns: dict[str, np.ndarray]) -> Path:
    """One raw Parquet file: arrays as flattened list columns, scalars as they are."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = {}
    for name, v in columns.items():
        if v.ndim > 1:
            flat = np.ascontiguousarray(v).reshape(len(v), -1)
            offsets = np.arange(0, flat.size + 1, flat.shape[1], dtype=np.int32)
            table[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.reshape(-1)))
        else:
            table[name] = pa.array(v)
    pq.write_table(pa.table(table), path, row_group_size=64)
    return path


def regression_raw(n: int = 300, seed: int = 0) -> dict[str, np.ndarray]:
    """Two features (float32 [4, 4], int64 [3]) and two float labels' worth of values (a float32 scalar
    `y`, a float64 scalar `w`)."""
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(n, 4, 4)).astype(np.float32),
            "extra": rng.integers(-2**40, 2**40, size=(n, 3)).astype(np.int64),
            "y": rng.normal(size=n).astype(np.float32)}


def regression_edit(location: Path) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        d["dataset"] = {"location": str(location), "label": "y", "split": {"validation": 0.1, "test": 0.1, "seed": 3},
                        "fields": [{"name": "image", "type": "float32", "shape": [4, 4]},
                                   {"name": "extra", "type": "int64", "shape": [3]}, {"name": "y", "type": "float32"}]}
        d["validation"] = {"rules": [{"kind": "finite", "column": "y"}]}
        d["training"].update(task="regression", model="mlp")
        for key in ("metric", "mode", "threshold"):
            d["evaluation"].pop(key, None)

    return edit


def segmentation_edit(location: Path, *, size: int = 32) -> Callable[[dict], None]:
    """The example spec on `ballast data segmentation`'s output (float32 images, int64 masks, 4 classes)."""

    def edit(d: dict) -> None:
        d["dataset"] = {"location": str(location), "label": "mask", "num_classes": 4,
                        "split": {"validation": 0.1, "test": 0.1, "seed": 3},
                        "fields": [{"name": "image", "type": "float32", "shape": [size, size]},
                                   {"name": "mask", "type": "int64", "shape": [size, size]}]}
        d["validation"] = {"rules": [{"kind": "between", "column": "image", "min": 0.0, "max": 1.0}]}
        d["training"].update(task="segmentation", model={"name": "unet", "options": {}})
        d["training"].pop("hidden_size", None)
        for key in ("metric", "mode", "threshold"):
            d["evaluation"].pop(key, None)

    return edit


def rows_by_split(columns: dict[str, np.ndarray], *, validation: float = 0.1, test: float = 0.1,
                  seed: int = 3) -> dict[str, dict[str, np.ndarray]]:
    """The raw columns' rows of each split, in row order."""
    n = len(next(iter(columns.values())))
    codes = split_codes(np.arange(n), validation=validation, test=test, seed=seed)
    return {split: {k: v[codes == c] for k, v in columns.items()} for c, split in enumerate(SPLITS)}
