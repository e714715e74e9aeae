"""Text to training sequences: the byte vocabulary and a tokenizers file, documents joined with
end-of-text and cut into seq_len + 1 token rows per split, exactly what a plain reimplementation gives;
the dataset id follows the tokenizer file; memory stays bounded whatever the corpus; bad inputs get one
located line before any data is read."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from ballast.data.packing import SPLITS, split_codes
from ballast.data.progress import progress_key
from ballast.data.text import SequenceCutter, byte_tokenizer, check_token_ids, file_tokenizer, text_shard_rows
from ballast.errors import DataError, SpecError
from ballast.spec import parse_spec
from ballast.stages import convert, validate
from ballast.training.dataset.reader import load_split
from datasets import (BYTE_EOT, corpus_texts, expected_sequences, text_edit, train_tokenizer, utf8_ids,
                      write_texts)
from helpers import example_data, make_ctx, run_chain

SEQ = 16


@pytest.mark.unit
def test_the_byte_vocabulary_is_the_utf8_bytes():
    texts = ["héllo 🙂", "", "ab"]
    ids, lengths = byte_tokenizer().encode(pa.array(texts).slice(0, 3))
    assert ids.dtype == np.int32 and ids.tolist() == [b for t in texts for b in t.encode()]
    assert lengths.tolist() == [len(t.encode()) for t in texts]
    tail, n = byte_tokenizer().encode(pa.array(texts).slice(2))  # an offset into Arrow's buffers
    assert tail.tolist() == list(b"ab") and n.tolist() == [2]
    tok = byte_tokenizer()
    assert (tok.vocab_size, tok.eot_id, tok.token_bytes[:2], tok.token_bytes[256]) == (257, 256, [1, 1], 0)


@pytest.mark.unit
def test_documents_are_joined_with_end_of_text_and_cut_without_padding():
    docs = [[1, 2, 3], [4, 5], [], [6, 7, 8, 9, 10]]
    cut = SequenceCutter(row_len=3, shard_rows=2, eot_id=99)
    shards = list(cut.add(np.asarray([t for d in docs[:2] for t in d], np.int32), np.asarray([3, 2])))
    shards += list(cut.add(np.asarray([t for d in docs[2:] for t in d], np.int32), np.asarray([0, 5])))
    shards += list(cut.finish())
    stream = [1, 2, 3, 99, 4, 5, 99, 99, 6, 7, 8, 9, 10]  # no end-of-text before the first document
    assert [s.shape for s in shards] == [(2, 3), (2, 3)]
    assert np.concatenate(shards).ravel().tolist() == stream[:12]  # the partial row [10] is dropped
    assert (cut.documents, cut.tokens) == (4, 13)


@pytest.mark.unit
def test_a_trained_tokenizer_file_says_the_bytes_each_token_stands_for():
    texts = corpus_texts(60)
    hf = train_tokenizer(texts)
    tok = file_tokenizer(hf.to_str().encode(), "team.json")
    assert tok.kind == "file" and tok.eot_id == hf.token_to_id("<|endoftext|>") and tok.token_bytes[tok.eot_id] == 0
    assert tok.vocab_size == hf.get_vocab_size() and len(tok.token_bytes) == tok.vocab_size
    ids, lengths = tok.encode(pa.array(texts))
    assert ids.tolist() == [i for t in texts for i in hf.encode(t, add_special_tokens=False).ids]
    # every document's tokens stand for exactly its UTF-8 bytes: what bits per byte divides by
    at = 0
    for text, n in zip(texts, lengths.tolist()):
        assert sum(tok.token_bytes[i] for i in ids[at:at + n]) == len(text.encode("utf-8"))
        at += n


@pytest.mark.unit
def test_a_tokenizer_file_without_end_of_text_or_not_json_is_one_line():
    hf = train_tokenizer(corpus_texts(20))
    with pytest.raises(SpecError, match=r"^dataset\.tokenizer: team\.json has '<eot>' in its vocabulary"):
        file_tokenizer(hf.to_str().encode(), "team.json", eot="<eot>")
    with pytest.raises(SpecError, match=r"^dataset\.tokenizer\.file: team\.json is not a tokenizers JSON file"):
        file_tokenizer(b"{not json", "team.json")


def _lm(tmp_path: Path, **kw):
    data = example_data()
    text_edit(tmp_path / "raw.parquet", **kw)(data)
    return data


@pytest.mark.unit
@pytest.mark.parametrize("name,edit,message", [
    ("text_not_a_field", lambda d: d["dataset"].update(text="body"),
     r"dataset\.text: 'body' is not one of the fields \(text\)"),
    ("text_not_a_string", lambda d: d["dataset"]["fields"][0].update(type="int64", shape=[4]),
     r"dataset\.text: field 'text' must be a scalar string \(got int64 \[4\]\)"),
    ("no_text_for_a_string", lambda d: d["dataset"].pop("text"),
     r"dataset\.tokenizer: only a text dataset is tokenized"),
    ("string_feature", lambda d: d["dataset"]["fields"].append({"name": "title", "type": "string"}),
     r"dataset\.fields: string field\(s\) title"),
    ("empty_tokenizer", lambda d: d["dataset"].update(tokenizer={}),
     r"dataset\.tokenizer: .*give `kind: bytes` or `file: <tokenizer JSON in storage>`"),
    ("bytes_with_a_file", lambda d: d["dataset"].update(tokenizer={"kind": "bytes", "file": "t.json"}),
     r"dataset\.tokenizer: .*kind bytes takes no file"),
    ("duplicate_share_without_max", lambda d: d["validation"]["rules"][1].pop("max"),
     r"validation\.rules\[1\]: rule 'duplicate_share' needs max"),
    ("text_length_without_bounds", lambda d: d["validation"]["rules"][0].update(min=None, max=None),
     r"validation\.rules\[0\]: rule 'text_length' needs min, max or both"),
    ("text_rule_on_another_field", lambda d: (d["dataset"]["fields"].append({"name": "n", "type": "int64"}),
                                               d["validation"]["rules"][0].update(field="n")),
     r"validation\.rules\[0\]\.column: rule 'text_length' checks the text column \(dataset\.text: 'text'\), not 'n'"),
    ("field_and_column", lambda d: d["validation"]["rules"][0].update(column="text"),
     r"validation\.rules\[0\]: give `column` or `field`, not both"),
])
def test_a_bad_text_spec_is_one_located_line_at_lint_time(tmp_path, name, edit, message):
    d = _lm(tmp_path)
    edit(d)
    with pytest.raises(SpecError, match=message) as info:
        parse_spec(d)
    assert "\n" not in str(info.value), name


@pytest.mark.unit
def test_a_language_model_without_text_is_refused_naming_dataset_text(tmp_path):
    d = _lm(tmp_path)
    d["dataset"].pop("text")
    d["dataset"].pop("tokenizer")
    with pytest.raises(SpecError, match=r"dataset\.(text|fields)") as info:
        parse_spec(d)
    assert "\n" not in str(info.value)


def _split_tokens(ctx, out, fmt: str) -> dict[str, np.ndarray]:
    root = Path(ctx.storage.local_path(out.prefix))
    return {s: load_split(root, s, fmt=fmt).features for s in ("train", "validation", "test")}


@pytest.mark.integration
def test_the_byte_vocabulary_turns_a_corpus_into_exactly_the_planned_sequences(tmp_path):
    texts = corpus_texts()
    ctx = make_ctx(tmp_path, write_texts(tmp_path / "raw" / "part-0.parquet", texts), text_edit(tmp_path / "raw"))
    out = run_chain(ctx, validate, convert)["convert"]
    want = expected_sequences(texts, utf8_ids, seq_len=SEQ, eot=BYTE_EOT)
    for fmt in ("petastorm", "tfrecord"):
        got = _split_tokens(ctx, out, fmt)
        for split, rows in want.items():
            assert got[split].dtype == np.int64 and np.array_equal(got[split], rows), (fmt, split)
    assert out.rows == {s: len(r) for s, r in want.items()}
    manifest = json.loads(ctx.storage.read_bytes(f"{out.prefix}/manifest.json"))
    assert manifest["columns"] == [{"name": "tokens", "dtype": "int32", "shape": [SEQ + 1], "codec": "ndarray",
                                    "role": "feature"}]
    assert manifest["task"] == "causal_lm" and manifest["num_classes"] is None
    assert {k: manifest["tokenizer"][k] for k in ("kind", "vocab_size", "eot_id")} == \
        {"kind": "bytes", "vocab_size": 257, "eot_id": 256}
    assert manifest["text"]["splits"]["train"]["documents"] + manifest["text"]["splits"]["test"]["documents"] + \
        manifest["text"]["splits"]["validation"]["documents"] == len(texts)
    progress = json.loads(ctx.storage.read_bytes(progress_key(ctx.run_key, "convert")))  # what the view shows
    assert (progress["what"], progress["unit"], progress["done"], progress["total"], progress["finished"]) == \
        ("tokenize", "documents", len(texts), len(texts), True)


@pytest.mark.integration
def test_a_tokenizer_file_in_storage_tokenizes_and_its_hash_is_in_the_dataset_id(tmp_path):
    texts = corpus_texts()
    hf = train_tokenizer(texts)
    raw = write_texts(tmp_path / "raw" / "part-0.parquet", texts)
    edit = text_edit(tmp_path / "raw", tokenizer={"file": "tokenizers/team.json"})
    ctx = make_ctx(tmp_path, raw, edit)
    ctx.storage.write_bytes("tokenizers/team.json", hf.to_str().encode())
    out = run_chain(ctx, validate, convert)["convert"]
    eot = hf.token_to_id("<|endoftext|>")
    encode = lambda batch: [e.ids for e in hf.encode_batch(batch, add_special_tokens=False)]  # noqa: E731
    want = expected_sequences(texts, encode, seq_len=SEQ, eot=eot)
    got = _split_tokens(ctx, out, "tfrecord")
    assert all(np.array_equal(got[s], want[s]) for s in want)
    manifest = json.loads(ctx.storage.read_bytes(f"{out.prefix}/manifest.json"))
    import hashlib

    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(hf.to_str().encode()).hexdigest()
    assert manifest["tokenizer"]["eot_id"] == eot and manifest["tokenizer"]["token_bytes"][eot] == 0
    # The same file again: the conversion is reused. Another tokenizer under the same key: a new dataset.
    assert convert.run(ctx).reused and convert.run(ctx).dataset_id == out.dataset_id
    ctx.storage.write_bytes("tokenizers/team.json", train_tokenizer(texts, vocab_size=280).to_str().encode())
    again = convert.run(ctx)
    assert not again.reused and again.dataset_id != out.dataset_id
    longer = make_ctx(tmp_path, raw, text_edit(tmp_path / "raw", tokenizer={"file": "tokenizers/team.json"},
                                                seq_len=SEQ * 2))
    longer.save_result("validate", ctx.result("validate"))
    assert convert.dataset_id(longer, out.dataset_id) != convert.dataset_id(ctx, out.dataset_id)


@pytest.mark.integration
def test_a_missing_tokenizer_fails_validation_before_any_data_is_read(tmp_path):
    ctx = make_ctx(tmp_path, tmp_path / "nowhere", text_edit(tmp_path / "nowhere", tokenizer={"file": "tok/x.json"}))
    with pytest.raises(SpecError, match=r"^dataset\.tokenizer\.file: 'tok/x\.json' is neither a key in storage"):
        validate.run(ctx)  # the raw location does not exist either: the tokenizer is looked at first


@pytest.mark.integration
def test_empty_documents_fail_the_text_length_rule_and_spark_does_not_tokenize(tmp_path):
    texts = corpus_texts(60)
    texts[7] = ""
    ctx = make_ctx(tmp_path, write_texts(tmp_path / "raw" / "part-0.parquet", texts), text_edit(tmp_path / "raw"))
    with pytest.raises(DataError, match=r"text__len.*1 rows"):
        validate.run(ctx)
    ctx = make_ctx(tmp_path, tmp_path / "raw", lambda d: (text_edit(tmp_path / "raw")(d),
                                                           d["conversion"].update(engine="spark")))
    with pytest.raises(SpecError, match=r"^conversion\.engine: spark does not tokenize text"):
        convert.run(ctx)


# VmHWM, this process image's peak: getrusage's ru_maxrss would also count the forking parent's
# resident pages (Linux keeps the larger of the old and the new image's peak across exec).
RSS_SCRIPT = r"""
import json, re, sys
from pathlib import Path
from ballast.pipeline.context import RunContext
from ballast.spec import parse_spec
from ballast.stages import convert
spec, dag, run = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
out = convert.run(RunContext(spec=parse_spec(spec), dag_id=dag, run_id=run))
peak = int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))
print(json.dumps({"rss_kb": peak, "rows": out.rows}))
"""


@pytest.mark.integration
def test_conversion_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak RSS of the convert stage (in a process of its own) on a corpus and on 6x that corpus."""
    base = corpus_texts(400, seed=1)
    peaks = {}
    for times in (1, 6):
        texts = [f"{t} copy {k}" for k in range(48 * times) for t in base]
        raw = write_texts(tmp_path / f"raw{times}" / "part-0.parquet", texts, docs_per_group=256)
        data = example_data()
        text_edit(raw.parent, rules=[], seq_len=64)(data)
        data["storage"]["uri"] = str(tmp_path / f"storage{times}")
        data["conversion"].update(shard_rows=2048, read_batch_rows=512)  # what the measured convert reads with
        # Validation (not measured here) in large batches: one GX run per 64Ki documents, not per 512.
        ctx = make_ctx(tmp_path, raw, lambda d, data=data: (d.update(json.loads(json.dumps(data))),
                                                            d["conversion"].update(read_batch_rows=65536)))
        run_chain(ctx, validate)
        proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, json.dumps(data), ctx.dag_id, ctx.run_id],
                              capture_output=True, text=True, timeout=600, env=os.environ.copy())
        assert proc.returncode == 0, proc.stderr[-2000:]
        peaks[times] = json.loads(proc.stdout.strip().splitlines()[-1])
    text_mb = {t: sum(len(s.encode()) for s in base) * 48 * t / 1e6 for t in peaks}
    assert text_mb[6] > 20  # 6x the corpus is far more than the budget below
    grown_mb = (peaks[6]["rss_kb"] - peaks[1]["rss_kb"]) / 1024
    assert peaks[6]["rows"]["train"] > 5 * peaks[1]["rows"]["train"]
    assert peaks[6]["rss_kb"] <= 1.2 * peaks[1]["rss_kb"], (peaks, text_mb, grown_mb)


@pytest.mark.integration
def test_a_quarantined_document_is_kept_aside_with_its_text_and_left_out_of_the_sequences(tmp_path):
    import pyarrow.parquet as pq

    texts = corpus_texts(80)
    texts[7] = ""
    ctx = make_ctx(tmp_path, write_texts(tmp_path / "raw" / "part-0.parquet", texts),
                   lambda d: (text_edit(tmp_path / "raw")(d),
                              d["validation"].update(on_failure="quarantine", max_bad_fraction=0.05)))
    out = run_chain(ctx, validate, convert)
    q = out["validate"].quarantine
    assert q is not None and q.rows == 1
    kept = pq.read_table(ctx.storage.local_path(q.file)).to_pylist()
    assert kept == [{"text": "", "_row": 7, "_failed": "expect_column_values_to_be_between(text__len)"}]
    # the other documents keep their row ids, so their splits; row 7 is simply not there
    codes = split_codes(np.arange(len(texts)), validation=0.1, test=0.1, seed=3)
    got = _split_tokens(ctx, out["convert"], "petastorm")
    for k, split in enumerate(SPLITS):
        stream: list[int] = []
        for i in np.flatnonzero(codes == k):
            if i != 7:
                stream += ([BYTE_EOT] if stream else []) + list(texts[i].encode())
        rows = len(stream) // (SEQ + 1)
        assert np.array_equal(got[split], np.asarray(stream[:rows * (SEQ + 1)]).reshape(rows, SEQ + 1)), split
    progress = json.loads(ctx.storage.read_bytes(progress_key(ctx.run_key, "convert")))
    assert progress["done"] == progress["total"] == len(texts) and progress["finished"]  # quarantined ones too


@pytest.mark.unit
def test_token_bytes_of_a_tokenizer_that_is_not_byte_level_come_from_decoding_each_id():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "naïve": 2, "数据": 3, "x": 4}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["</s>"])
    tok = file_tokenizer(hf.to_str().encode(), "words.json")
    assert tok.eot_id == 1 and tok.token_bytes[1] == 0  # </s> found as the end-of-text, a special token
    assert tok.token_bytes[2:] == [len("naïve".encode()), len("数据".encode()), 1]


def _word_level(vocab: dict[str, int]) -> bytes:
    """A tokenizers JSON file of a WordLevel vocabulary as given (ids need not be dense), split on
    whitespace, <|endoftext|> its special token."""
    eot = {"id": vocab["<|endoftext|>"], "content": "<|endoftext|>", "single_word": False, "lstrip": False,
           "rstrip": False, "normalized": False, "special": True}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [eot],
                       "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
                       "decoder": None, "model": {"type": "WordLevel", "vocab": vocab,
                                                   "unk_token": "<|endoftext|>"}}).encode()


@pytest.mark.unit
def test_a_vocabulary_whose_largest_id_is_past_the_bound_is_refused_naming_the_file_the_id_and_the_bound():
    data = _word_level({"<|endoftext|>": 0, "a": 2147483646})  # 2 entries, the second id 2**31 - 2
    with pytest.raises(SpecError, match=r"^dataset\.tokenizer\.file: sparse\.json: its largest token id is"
                                        r" 2147483646 \('a'\), past the bound of 2097152 ids") as info:
        file_tokenizer(data, "sparse.json")
    assert "\n" not in str(info.value)


@pytest.mark.unit
def test_the_recorded_vocab_size_of_a_sparse_vocabulary_is_its_largest_id_plus_one():
    tok = file_tokenizer(_word_level({"<|endoftext|>": 0, "a": 1000, "bc": 7}), "sparse.json")
    assert tok.vocab_size == 1001 and len(tok.token_bytes) == 1001  # not the 3 entries get_vocab_size() counts
    assert tok.token_bytes[0] == 0 and tok.token_bytes[7] == 2 and tok.token_bytes[1000] == 1
    assert sum(tok.token_bytes) == 3  # the ids the vocabulary skips stand for no bytes
    ids, lengths = tok.encode(pa.array(["a bc a", "bc"]))
    assert ids.tolist() == [1000, 7, 1000, 7] and lengths.tolist() == [3, 1]
    check_token_ids(ids, lengths, tok.vocab_size, np.asarray([5, 9]), "raw/part-0.parquet", tok.describe)


@pytest.mark.unit
@pytest.mark.parametrize("bad,row", [(1001, 11), (2147483646, 11), (-1, 12)])
def test_a_token_id_outside_the_vocabulary_is_one_line_naming_the_document_and_the_id(bad, row):
    tokens = np.asarray([1, 2, 3, 4, 1000, 6], np.int64)  # documents of 3, 2, 0 and 1 tokens: rows 10, 11, 13, 12
    tokens[4 if row == 11 else 5] = bad
    lengths = np.asarray([3, 2, 0, 1])
    with pytest.raises(DataError, match=rf"^raw/part-0\.parquet: row {row}: words\.json gave token id {bad},"
                                        r" outside its vocabulary \(ids 0 to 1000, ") as info:
        check_token_ids(tokens, lengths, 1001, np.asarray([10, 11, 13, 12]), "raw/part-0.parquet", "words.json")
    assert "\n" not in str(info.value)


@pytest.mark.integration
def test_conversion_refuses_a_token_id_past_the_recorded_vocabulary_naming_the_raw_file_and_row(tmp_path,
                                                                                                 monkeypatch):
    """A tokenizer whose recorded vocabulary is smaller than the ids it gives: the byte vocabulary cut to
    ASCII (ids 0-127), on documents with multi-byte characters."""
    import dataclasses

    from ballast.data import text

    texts = corpus_texts(60)
    raw = write_texts(tmp_path / "raw" / "part-0.parquet", texts)
    ctx = make_ctx(tmp_path, raw, text_edit(tmp_path / "raw"))
    run_chain(ctx, validate)
    ascii_only = dataclasses.replace(byte_tokenizer(), vocab_size=128, token_bytes=[1] * 128)
    monkeypatch.setattr(text, "load_tokenizer", lambda ctx: ascii_only)
    with pytest.raises(DataError, match=r"part-0\.parquet: row \d+: the byte vocabulary gave token id \d+") as info:
        convert.run(ctx)
    message = str(info.value)
    assert "\n" not in message and "ids 0 to 127" in message
    row, bad = (int(x) for x in re.search(r"row (\d+): .* token id (\d+)", message).groups())
    assert bad >= 128 and bad in texts[row].encode()  # the row named is a document holding that byte


@pytest.mark.unit
def test_a_shard_holds_at_most_text_shard_bytes_of_tokens():
    assert text_shard_rows(10_000_000, 1_048_575) == 16  # 64 MiB / 4 MiB sequences (1Mi int32 tokens)
    assert text_shard_rows(10_000_000, 1_048_576) == 15  # 4 bytes more a sequence: 16 would pass the bound
    assert text_shard_rows(8, 16) == 8  # small sequences: shard_rows as set
    assert text_shard_rows(1000, 16 << 20) == 1  # a sequence past the bound: one a shard


@pytest.mark.integration
def test_long_sequences_are_cut_into_shards_of_at_most_the_byte_bound_and_read_back_in_order(tmp_path,
                                                                                             monkeypatch):
    import pyarrow.parquet as pq
    from ballast.data import text

    seq_len, row_bytes = 64, 65 * 4
    bound = 3 * row_bytes + 100  # three sequences a shard; shard_rows alone would make one shard a split
    monkeypatch.setattr(text, "TEXT_SHARD_BYTES", bound)
    texts = corpus_texts()
    raw = write_texts(tmp_path / "raw" / "part-0.parquet", texts)
    ctx = make_ctx(tmp_path, raw, lambda d: (text_edit(tmp_path / "raw", seq_len=seq_len)(d),
                                             d["conversion"].update(shard_rows=100_000)))
    out = run_chain(ctx, validate, convert)["convert"]
    want = expected_sequences(texts, utf8_ids, seq_len=seq_len, eot=BYTE_EOT)
    assert len(want["train"]) > 6  # enough sequences for several shards
    root = Path(ctx.storage.local_path(out.prefix))
    manifest = json.loads((root / "manifest.json").read_text())
    shards = [e for e in manifest["files"] if e.get("kind") != "metadata"]
    for split, rows in want.items():
        parquet = sorted((root / "petastorm" / split).glob("part-*.parquet"))
        counts = [pq.ParquetFile(p).metadata.num_rows for p in parquet]
        assert sum(counts) == len(rows) and all(n * row_bytes <= bound for n in counts), (split, counts)
        assert len(counts) == -(-len(rows) // 3), (split, counts)
        tf = [e["rows"] for e in shards if e["split"] == split and e["format"] == "tfrecord"]
        assert tf == counts, split
    for fmt in ("petastorm", "tfrecord"):
        got = _split_tokens(ctx, out, fmt)
        assert all(np.array_equal(got[s], want[s]) for s in want), fmt
