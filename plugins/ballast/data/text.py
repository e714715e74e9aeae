"""Text to training sequences: a language model's documents, tokenized, joined and cut, streamed.

The raw input is Parquet with a text column (`dataset.text`), one document per row. Documents go to
train/validation/test by the same hash of their row id as any other dataset's rows; each split's
documents are joined in row order with end-of-text between them and cut into `seq_len + 1` token
sequences (no padding: a split's last partial sequence is dropped), written as the int32 `tokens`
column, shard by shard (ballast.data.packing). Memory is bounded by one raw row group, a slice of at
most TEXT_SLICE_BYTES of text and one shard per split of at most TEXT_SHARD_BYTES of tokens, never by the
corpus nor by seq_len x conversion.shard_rows.

Two tokenizers (`dataset.tokenizer`): the byte vocabulary (`{kind: bytes}`: ids 0-255 are the UTF-8
bytes, 256 is end-of-text; done with numpy on Arrow's buffers, no Python object per document), or a
Hugging Face `tokenizers` JSON file from the pipeline's storage (`{file: KEY}`, `encode_batch`). The
manifest's `tokenizer` entry records kind, sha256 of the file, vocab_size (the largest id + 1, at most
MAX_VOCAB_IDS), eot_id and `token_bytes`, the UTF-8 bytes each id stands for (0 for special tokens and for
ids the vocabulary skips), from which bits per byte is computed. Every token id conversion writes is
checked against vocab_size, a batch at a time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ballast.errors import DataError, SpecError, StorageError

TOKENS = "tokens"
BYTE_EOT = 256
TEXT_SLICE_BYTES = 4 << 20
TEXT_SHARD_BYTES = 64 << 20
"""The most token bytes one shard holds (rows x (seq_len + 1) x 4): a split's shard is cut at
min(conversion.shard_rows, TEXT_SHARD_BYTES // row bytes) rows, at least one. What a split buffers (and
the shard's encoded copies while it is written) then stays about this size, whatever seq_len x shard_rows
(up to 4 MiB x 10M rows allowed by the spec). The other converters cut by shard_rows alone: their rows are
the raw rows, read conversion.read_batch_rows at a time, not sequences of up to a million tokens."""
MAX_VOCAB_IDS = 1 << 21
"""The most ids a tokenizer file may have: its largest id + 1 (the recorded vocab_size) at most 2,097,152.
Real vocabularies stay far below (GPT-2 50,257; Llama 3 128,256; Gemma 262,144). The bound is not 1 << 24:
the manifest records one token_bytes entry per id up to the largest, and training turns that list into a
tensor and the model into an embedding row per id; 16Mi ids is a 50 MB manifest read by every later stage
(2 s to write, 1.3 s to parse, measured), for a vocabulary that is sparse or corrupt (ids are u32: a file
can name id 2147483646 for its second token)."""
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


@dataclass
class TextTokenizer:
    """A loaded tokenizer: what the manifest records of it and how a batch of documents is encoded."""

    kind: str                       # bytes or file
    vocab_size: int
    eot_id: int
    token_bytes: list[int]
    sha256: str | None = None       # of the tokenizer file (kind file)
    source: str = "the byte vocabulary"
    hf: Any = field(default=None, repr=False)

    @property
    def describe(self) -> str:
        return self.source if self.kind == "bytes" else f"{self.source} (sha256 {self.sha256[:12]})"

    def manifest_entry(self) -> dict:
        return {"kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size, "eot_id": self.eot_id,
                "token_bytes": self.token_bytes}

    def encode(self, texts: Any) -> tuple[Any, Any]:
        """(token ids int32 of every document, concatenated; each document's token count) of an Arrow
        string array."""
        import numpy as np
        import pyarrow as pa

        if self.kind == "bytes":
            arr = texts.cast(pa.large_string()) if not pa.types.is_large_string(texts.type) else texts
            n = len(arr)
            offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset:arr.offset + n + 1]
            data = arr.buffers()[2]
            raw = np.frombuffer(data, dtype=np.uint8)[offsets[0]:offsets[-1]] if data is not None and n else \
                np.zeros(0, np.uint8)
            return raw.astype(np.int32), np.diff(offsets)
        encodings = self.hf.encode_batch(texts.to_pylist(), add_special_tokens=False)
        try:
            arrays = [np.asarray(e.ids, dtype=np.int32) for e in encodings]  # one C-level copy per document
        except OverflowError:  # an id past int32 (ids are u32): kept as it is, for check_token_ids to name
            arrays = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        return ids, lengths


def byte_tokenizer() -> TextTokenizer:
    return TextTokenizer(kind="bytes", vocab_size=257, eot_id=BYTE_EOT, token_bytes=[1] * 256 + [0])


def tokenizer_bytes(ctx: Any, name: str) -> tuple[bytes, str]:
    """The tokenizer file `name`: a key in the pipeline's storage, else a path (relative paths under
    BALLAST_HOME). (its bytes, where it was found)."""
    from ballast.storage import resolve_local

    if not Path(name).is_absolute():
        try:
            if ctx.storage.exists(name):
                return ctx.storage.read_bytes(name), ctx.storage.describe(name)
        except (StorageError, ValueError):
            pass
    path = resolve_local(name)
    if path.is_file():
        return path.read_bytes(), str(path)
    raise SpecError(f"dataset.tokenizer.file: {name!r} is neither a key in storage {ctx.storage.uri} nor a file"
                    f" ({path}); upload the tokenizer JSON there or give its path")


def file_tokenizer(data: bytes, source: str, eot: str | None = None) -> TextTokenizer:
    """A Hugging Face tokenizers JSON file as a TextTokenizer; SpecError naming the problem."""
    import json

    from tokenizers import Tokenizer

    try:
        config = json.loads(data)
        hf = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # ValueError, UnicodeDecodeError, tokenizers' Exception
        raise SpecError(f"dataset.tokenizer.file: {source} is not a tokenizers JSON file"
                        f" ({str(exc).splitlines()[0][:200]})") from exc
    vocab = hf.get_vocab(with_added_tokens=True)
    names = [eot] if eot else [t for t in EOT_CANDIDATES if t in vocab]
    if not names or names[0] not in vocab:
        want = repr(eot) if eot else "none of " + ", ".join(EOT_CANDIDATES)
        raise SpecError(f"dataset.tokenizer: {source} has {want} in its vocabulary; name its end-of-text token"
                        f" in dataset.tokenizer.eot")
    # vocab_size is the largest id + 1, not get_vocab_size() (a count of entries): ids need not be dense,
    # and every id the tokenizer produces must be below what the manifest records (the model's embedding).
    top = max(vocab, key=vocab.__getitem__)
    size = vocab[top] + 1
    if size > MAX_VOCAB_IDS:
        raise SpecError(f"dataset.tokenizer.file: {source}: its largest token id is {vocab[top]} ({top!r}), past the"
                        f" bound of {MAX_VOCAB_IDS} ids (largest id {MAX_VOCAB_IDS - 1}, more than any real"
                        f" tokenizer has); number its {len(vocab)} tokens densely from 0")
    return TextTokenizer(kind="file", vocab_size=size, eot_id=vocab[names[0]], sha256=hashlib.sha256(data).hexdigest(),
                         token_bytes=token_bytes(hf, config, size), source=source, hf=hf)


def token_bytes(hf: Any, config: dict, size: int) -> list[int]:
    """UTF-8 bytes each id below `size` stands for: special tokens and ids not in the vocabulary 0; a
    byte-level vocabulary (GPT-2's: one character per byte) the token's length; any other the UTF-8
    length of the token decoded alone. Only the vocabulary's ids are looked at (a sparse one costs its
    entries, not its largest id)."""
    special = {i for i, t in _added_tokens(hf).items() if getattr(t, "special", False)}
    special |= {t["id"] for t in config.get("added_tokens") or [] if t.get("special")}
    decoders = config.get("decoder") or {}
    kinds = {d.get("type") for d in decoders.get("decoders", [decoders])} if isinstance(decoders, dict) else set()
    ids = sorted(i for i in set(hf.get_vocab(with_added_tokens=True).values()) if i < size and i not in special)
    out = [0] * size
    if "ByteLevel" in kinds:
        for i in ids:
            tok = hf.id_to_token(i)
            out[i] = 0 if tok is None else len(tok)
        return out
    for i, s in zip(ids, hf.decode_batch([[i] for i in ids], skip_special_tokens=False)):
        out[i] = len(s.encode("utf-8"))
    return out


def check_token_ids(tokens: Any, lengths: Any, vocab_size: int, row_ids: Any, where: str, tokenizer: str) -> None:
    """DataError, one line naming the document (its global row id in `where`) and the id, when a token id
    of a batch (`tokens`, each document's count in `lengths`) is outside 0 .. vocab_size - 1. Two numpy
    reductions a batch; the document is looked for only when one fails."""
    import numpy as np

    if not len(tokens) or (int(tokens.min()) >= 0 and int(tokens.max()) < vocab_size):
        return
    at = int(np.flatnonzero((tokens < 0) | (tokens >= vocab_size))[0])
    doc = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
    raise DataError(f"{where}: row {int(row_ids[doc])}: {tokenizer} gave token id {int(tokens[at])}, outside its"
                    f" vocabulary (ids 0 to {vocab_size - 1}, the vocab_size recorded); the tokenizer file is"
                    f" inconsistent: fix it so every id it produces is in its vocabulary")


def _added_tokens(hf: Any) -> dict:
    try:
        return dict(hf.get_added_tokens_decoder())
    except AttributeError:  # an older tokenizers
        return {}


def load_tokenizer(ctx: Any) -> TextTokenizer:
    """The spec's tokenizer (dataset.tokenizer; default the byte vocabulary)."""
    spec = ctx.spec.dataset.tokenizer_spec
    if spec.kind == "bytes":
        return byte_tokenizer()
    data, source = tokenizer_bytes(ctx, spec.file)
    return file_tokenizer(data, source, spec.eot)


# --- the stream: documents -> split streams -> sequences -> shards -----------------------------------------


def text_slices(chunk: Any, column: str, batch_rows: int, drop: Any) -> Iterator[tuple[Any, Any]]:
    """(global row ids, Arrow string array) of a raw row group, at most `batch_rows` documents and about
    TEXT_SLICE_BYTES of text at a time, without the quarantined rows (`drop`)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from ballast.training.hostmem import return_freed_memory

    return_freed_memory()  # each batch's decode buffers go back when freed (training.hostmem)
    try:
        pf = pq.ParquetFile(chunk.path)
        first = chunk.first_row
        for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[chunk.row_group], columns=[column]):
            ids = np.arange(first, first + batch.num_rows, dtype=np.int64)
            first += batch.num_rows
            col = batch.column(0)
            if drop is not None and drop.size:
                keep = ~np.isin(ids, drop)
                if not keep.all():
                    col, ids = col.filter(pa.array(keep)), ids[keep]
            if col.null_count:
                bad = int(ids[np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0]])
                raise DataError(f"{chunk.path}: row {bad}: text {column!r} is null; validate the data first")
            sizes = np.cumsum(pc.binary_length(col).to_numpy(zero_copy_only=False).astype(np.int64))
            start = 0
            while start < len(ids):
                base = sizes[start - 1] if start else 0
                stop = max(start + 1, int(np.searchsorted(sizes, base + TEXT_SLICE_BYTES, side="right")))
                yield ids[start:stop], col.slice(start, stop - start)
                start = stop
    except DataError:
        raise
    except Exception as exc:  # truncated files surface here, mid-read
        raise DataError(f"{chunk.path}: cannot read row group {chunk.row_group} ({exc})") from exc


class SequenceCutter:
    """One split's token stream cut into rows of `row_len` tokens, handed out `shard_rows` at a time."""

    def __init__(self, row_len: int, shard_rows: int, eot_id: int):
        self.row_len, self.shard_rows, self.eot_id = row_len, shard_rows, eot_id
        self.parts: list[Any] = []
        self.have = 0
        self.tokens = 0
        self.documents = 0

    def add(self, ids: Any, lengths: Any) -> Iterator[Any]:
        """Append documents (their ids, concatenated, and token counts) with end-of-text before each but
        the split's first; yields full shards (shard_rows, row_len) int32."""
        import numpy as np

        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        joined = np.insert(ids, starts, np.int32(self.eot_id)) if len(lengths) else ids
        if self.documents == 0 and len(joined):
            joined = joined[1:]
        self.documents += len(lengths)
        self.tokens += len(joined)
        self.parts.append(joined.astype(np.int32, copy=False))
        self.have += len(joined)
        while self.have >= self.shard_rows * self.row_len:
            yield self._take(self.shard_rows)

    def finish(self) -> Iterator[Any]:
        """The last shard: the full rows left; the partial row after them is dropped."""
        rows = self.have // self.row_len
        if rows:
            yield self._take(rows)
        self.parts, self.have = [], 0

    def _take(self, rows: int) -> Any:
        import numpy as np

        flat = np.concatenate(self.parts) if len(self.parts) > 1 else self.parts[0]
        n = rows * self.row_len
        self.parts = [flat[n:]] if len(flat) > n else []
        self.have = len(flat) - n
        return flat[:n].reshape(rows, self.row_len)


def text_shard_rows(shard_rows: int, seq_len: int) -> int:
    """Sequences a shard: conversion.shard_rows, fewer where that many rows of seq_len + 1 int32 tokens
    would pass TEXT_SHARD_BYTES; at least one."""
    return max(1, min(shard_rows, TEXT_SHARD_BYTES // ((seq_len + 1) * 4)))


def convert_text(chunks: list, spec: Any, bad_rows: Any, staging: Path, tokenizer: TextTokenizer, seq_len: int,
                 progress: Any = None) -> tuple[list[dict], dict]:
    """Tokenize, join, cut and write every split's sequences; (manifest entries, counts by split)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from ballast.data.packing import SPLITS, FeatureEncoder, split_codes, tokens_field, write_shard

    ds, conv = spec.dataset, spec.conversion
    enc = FeatureEncoder(tokens_field(seq_len))
    if tokenizer.vocab_size > np.iinfo(np.int32).max:
        raise DataError(f"dataset.tokenizer: a vocabulary of {tokenizer.vocab_size} ids does not fit int32 tokens")
    per_shard = text_shard_rows(conv.shard_rows, seq_len)
    cutters = {s: SequenceCutter(seq_len + 1, per_shard, tokenizer.eot_id) for s in SPLITS}
    shard_no = {s: 0 for s in SPLITS}
    entries: list[dict] = []
    text_bytes = 0

    def write(split: str, rows: Any) -> None:
        entries.extend(write_shard(staging, split, shard_no[split], {TOKENS: enc.encode(rows)}, formats=conv.formats,
                                   layouts=[enc.layout], row_group_rows=conv.row_group_rows))
        shard_no[split] += 1

    for chunk in chunks:
        done = 0
        for ids, texts in text_slices(chunk, ds.text, conv.read_batch_rows, bad_rows):
            codes = split_codes(ids, validation=ds.split.validation, test=ds.split.test, seed=ds.split.seed)
            for k, split in enumerate(SPLITS):
                sel = np.flatnonzero(codes == k)
                if sel.size:
                    docs = texts.take(pa.array(sel))
                    tokens, lengths = tokenizer.encode(docs)
                    check_token_ids(tokens, lengths, tokenizer.vocab_size, ids[sel], str(chunk.path),
                                    tokenizer.describe)
                    for rows in cutters[split].add(tokens, lengths):
                        write(split, rows)
            text_bytes += int(pc.sum(pc.binary_length(texts)).as_py() or 0)
            done += len(ids)
            if progress:
                progress.add(len(ids))
        if progress and chunk.rows > done:  # the chunk's quarantined documents count as done too
            progress.add(chunk.rows - done)
    for split in SPLITS:
        for rows in cutters[split].finish():
            write(split, rows)
    counts = {s: {"documents": c.documents, "tokens": c.tokens, "sequences": c.tokens // (seq_len + 1)}
              for s, c in cutters.items()}
    return entries, {"splits": counts, "text_bytes": text_bytes}


def tokenizer_fingerprint(ctx: Any) -> dict:
    """What of the tokenizer goes into the dataset id: its kind, and the file's sha256."""
    t = ctx.spec.dataset.tokenizer_spec
    if t.kind == "bytes":
        return {"kind": "bytes"}
    data, _ = tokenizer_bytes(ctx, t.file)
    return {"kind": "file", "sha256": hashlib.sha256(data).hexdigest(), "eot": t.eot}
