"""Tests for structured_attention.data: tokenizers, corpora and their cache, batch sampling.

Everything runs on small temporary files and a temporary cache folder, except the default-corpus
tests, which tokenise the running interpreter's standard library (about 12 MB, well under a second
with the byte tokenizer) and never touch ``../shared``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from structured_attention.data import (
    DOC_SEPARATOR,
    ByteTokenizer,
    CharTokenizer,
    Corpus,
    document_ids,
    eval_batches,
    load_corpus,
    sample_batch,
    split_documents,
    stdlib_files,
    tokenizer_from_json,
)

HAVE_DATASETS = importlib.util.find_spec("datasets") is not None
SHARD_FILES = ["meta.json", "train.bin", "train_docs.bin", "val.bin", "val_docs.bin"]

# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------

TEXT = "Hello, wörld! ∑ x² — naïve café 日本語 🙂\n\ttabs"


def test_byte_round_trip_non_ascii():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids) and tok.vocab_size == 256 and tok.name == "byte"
    assert tok.decode(ids) == TEXT
    assert tok.decode(np.array(ids, dtype=np.uint8)) == TEXT
    assert tok.decode(torch.tensor(ids)) == TEXT
    assert tok.encode_array(TEXT).tolist() == ids
    # A cut through a multi-byte character decodes with a replacement character, never raises.
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"
    assert tokenizer_from_json(json.loads(json.dumps(tok.to_json()))) == tok


def test_char_round_trip_unknown_and_json():
    tok = CharTokenizer.from_text(TEXT)
    assert tok.name == "char"
    assert tok.chars == tuple(sorted(set(TEXT)))
    assert tok.vocab_size == len(set(TEXT)) + 1  # + <unk> at id 0
    ids = tok.encode(TEXT)
    assert min(ids) >= 1 and tok.decode(ids) == TEXT
    assert tok.encode_array(TEXT).tolist() == ids and tok.encode_array(TEXT).dtype == np.uint16
    # ids follow the sorted vocabulary
    assert [tok.encode(c)[0] for c in tok.chars] == list(range(1, tok.vocab_size))
    # unknown characters map to 0 and decode as U+FFFD
    assert tok.encode("H#Z") == [tok.encode("H")[0], 0, 0]
    assert tok.encode_array("H#Z").tolist() == tok.encode("H#Z")
    assert tok.decode(tok.encode("H#")) == "H\ufffd"
    # json round trip, through real JSON text
    d = json.loads(json.dumps(tok.to_json()))
    assert d["name"] == "char" and d["vocab_size"] == tok.vocab_size
    again = CharTokenizer.from_json(d)
    assert again == tok and again.encode(TEXT) == ids
    assert tokenizer_from_json(d) == tok and isinstance(tokenizer_from_json(d), CharTokenizer)


def test_tokenizer_errors_name_parameter():
    with pytest.raises(ValueError, match=r"^d\['name'\]"):
        tokenizer_from_json({"name": "bpe"})
    with pytest.raises(ValueError, match=r"^ids"):
        ByteTokenizer().decode([300])
    with pytest.raises(ValueError, match=r"^ids"):
        CharTokenizer("ab").decode([3])


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def decode_all(corpus: Corpus, split: str) -> str:
    return corpus.tokenizer.decode(np.asarray(getattr(corpus, split)))


def make_folder(root: Path, n: int = 12) -> dict[str, str]:
    files = {f"d{i % 3}/file_{i:02d}.txt": f"contents of file {i} — ü\n" * (i + 1) for i in range(n)}
    for rel, text in files.items():
        write(root / rel, text)
    return files


# --------------------------------------------------------------------------------------------------
# The default corpus: the running interpreter's standard library
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_pair(tmp_path_factory):
    cache = tmp_path_factory.mktemp("stdlib-cache")
    first = load_corpus(cache_dir=cache)
    second = load_corpus("stdlib", cache_dir=cache)
    return first, second


def test_stdlib_corpus_deterministic_and_megabytes(stdlib_pair):
    a, b = stdlib_pair
    assert a.source.startswith("stdlib:") and isinstance(a.tokenizer, ByteTokenizer)
    assert (len(a.train), len(a.val)) == (len(b.train), len(b.val))
    assert np.array_equal(a.train[:4096], b.train[:4096]) and np.array_equal(a.val[:4096], b.val[:4096])
    assert a.path == b.path
    total = a.train_bytes + a.val_bytes
    assert 3_000_000 < total < 60_000_000, total  # about 12-13 MB for CPython 3.11
    assert a.train_bytes == len(a.train) and a.val_bytes == len(a.val)  # byte tokenizer
    assert a.val_bytes_per_token == 1.0
    assert 0.03 < a.val_bytes / total < 0.3
    assert isinstance(a.train, np.memmap) and a.train.dtype == np.uint8 and a.train.ndim == 1


def test_stdlib_corpus_split_by_file_and_excludes_tests(stdlib_pair):
    corpus, _ = stdlib_pair
    train_docs, val_docs = corpus.meta["train_documents"], corpus.meta["val_documents"]
    assert train_docs and val_docs and not set(train_docs) & set(val_docs)
    assert train_docs == sorted(train_docs) and val_docs == sorted(val_docs)
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    # every non-empty file is in exactly one split; empty ones (some __init__.py) are skipped
    non_empty = [f for f in files if (root / f).stat().st_size > 0]
    assert sorted(train_docs + val_docs) == non_empty and len(non_empty) > 300
    assert any(f == "os.py" for f in files) and any(f.startswith("asyncio/") for f in files)
    for f in files:
        parts = f.split("/")
        assert f.endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1]), f
    # The split is by whole files, in sorted order: validation starts with the first val file.
    first_val = (root / val_docs[0]).read_bytes()
    assert bytes(corpus.val[: len(first_val)]) == first_val
    assert split_documents(non_empty, 0.1) == [f in set(val_docs) for f in non_empty]


# --------------------------------------------------------------------------------------------------
# Files and folders
# --------------------------------------------------------------------------------------------------


def test_folder_sorted_split_by_file_skips_binaries(tmp_path):
    files = make_folder(tmp_path / "corpus")
    write(tmp_path / "corpus" / "image.bin", b"\x89PNG\x00\x01\x02")  # binary: skipped
    write(tmp_path / "corpus" / ".hidden.txt", "hidden")  # hidden: skipped
    write(tmp_path / "corpus" / "empty.txt", "")  # empty: skipped
    corpus = load_corpus(tmp_path / "corpus", val_fraction=0.3, cache_dir=tmp_path / "cache")
    names = sorted(files)
    train_docs, val_docs = corpus.meta["train_documents"], corpus.meta["val_documents"]
    assert sorted(train_docs + val_docs) == names and not set(train_docs) & set(val_docs)
    assert train_docs and val_docs
    assert split_documents(names, 0.3) == [n in val_docs for n in names]
    assert decode_all(corpus, "train") == DOC_SEPARATOR.join(files[n] for n in names if n in train_docs)
    assert decode_all(corpus, "val") == DOC_SEPARATOR.join(files[n] for n in names if n in val_docs)
    assert corpus.train_bytes == len(decode_all(corpus, "train").encode())
    assert corpus.source.startswith("folder:")


def test_split_documents_is_stable_and_keeps_both_sides(tmp_path):
    names = [f"f{i}.txt" for i in range(200)]
    is_val = split_documents(names, 0.1)
    assert 5 <= sum(is_val) <= 40
    # A file's side does not depend on the other files.
    assert split_documents(names[:100], 0.1) == is_val[:100]
    # Two files: both sides are non-empty whatever the fraction.
    for frac in (0.01, 0.5, 0.99):
        assert sorted(split_documents(["a", "b"], frac)) == [False, True]


def test_single_file_split_by_fraction(tmp_path):
    text = "".join(f"line {i}: ünïcode\n" for i in range(100))
    path = write(tmp_path / "one.txt", text)
    corpus = load_corpus(path, tokenizer="char", val_fraction=0.25, cache_dir=tmp_path / "cache")
    n_val = round(0.25 * len(text))
    assert decode_all(corpus, "train") == text[:-n_val]
    assert decode_all(corpus, "val") == text[-n_val:]
    assert len(corpus.val) == n_val and corpus.train.dtype == np.uint16
    assert corpus.val_bytes == len(text[-n_val:].encode()) and corpus.source.startswith("file:")
    assert corpus.val_bytes_per_token == pytest.approx(corpus.val_bytes / n_val)
    assert corpus.bits_per_byte(math.log(2)) == pytest.approx(1 / corpus.val_bytes_per_token)
    # A folder holding one file splits the same way.
    folder = tmp_path / "only"
    write(folder / "one.txt", text)
    same = load_corpus(folder, tokenizer="char", val_fraction=0.25, cache_dir=tmp_path / "cache")
    assert same.path == corpus.path


def test_char_vocabulary_from_train_only(tmp_path):
    path = write(tmp_path / "t.txt", "aaaabbbbcccc" * 10 + "XYZ")
    corpus = load_corpus(path, tokenizer="char", val_fraction=0.1, cache_dir=tmp_path / "cache")
    assert corpus.tokenizer.chars == ("a", "b", "c")
    assert corpus.val[-3:].tolist() == [0, 0, 0]  # X, Y, Z unseen in training: <unk>
    assert corpus.meta["tokenizer"] == corpus.tokenizer.to_json()


def test_bits_per_byte_byte_tokenizer(tmp_path):
    corpus = load_corpus(write(tmp_path / "t.txt", "abcdefgh" * 50), cache_dir=tmp_path / "c")
    assert corpus.val_bytes_per_token == 1.0
    assert corpus.bits_per_byte(2 * math.log(2)) == pytest.approx(2.0)


# --------------------------------------------------------------------------------------------------
# Document starts
# --------------------------------------------------------------------------------------------------

# Blank lines inside documents ("\n\n", the separator itself) and multi-byte characters.
DOCS = {
    "a.py": "def f():\n    return 1\n\n\ndef g():\n    return 2\n",
    "b/c.py": "x = 'naïve café'\n\nprint(x)\n",
    "b/d.py": "# 日本語 🙂\n\n\n\nclass C:\n    pass\n",
    "e.txt": "plain text\n\nwith paragraphs\n\nand more",
    "d.py": "# title\n\nbody = '∑ x²'\n",
    "g.py": "import os\n\n\n\n",
}


def document_texts(corpus: Corpus, split: str) -> list[str]:
    """Each document of ``split`` decoded from the tokens between consecutive recorded starts."""
    tokens = np.asarray(getattr(corpus, split))
    bounds = [*getattr(corpus, f"{split}_document_starts").tolist(), len(tokens)]
    return [corpus.tokenizer.decode(tokens[a:b]) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("tokenizer", ["byte", "char"])
def test_document_starts_match_the_documents(tmp_path, tokenizer):
    for rel, text in DOCS.items():
        write(tmp_path / "corpus" / rel, text)
    corpus = load_corpus(tmp_path / "corpus", tokenizer=tokenizer, val_fraction=0.5, cache_dir=tmp_path / "cache")
    for split in ("train", "val"):
        names = corpus.meta[f"{split}_documents"]
        starts = getattr(corpus, f"{split}_document_starts")
        assert len(names) >= 2 and starts.dtype == np.int64 and not starts.flags.writeable
        assert starts[0] == 0 and len(starts) == len(names)
        # The separator belongs to the document before it; the last document has none.
        expected = [DOCS[n] + DOC_SEPARATOR for n in names[:-1]] + [DOCS[names[-1]]]
        if split == "val":  # characters the char vocabulary (built from training) lacks come back as U+FFFD
            expected = [corpus.tokenizer.decode(corpus.tokenizer.encode(t)) for t in expected]
        assert document_texts(corpus, split) == expected
    # Read back from the cache, the starts are the same.
    again = load_corpus(tmp_path / "corpus", tokenizer=tokenizer, val_fraction=0.5, cache_dir=tmp_path / "cache")
    assert np.array_equal(again.train_document_starts, corpus.train_document_starts)
    assert np.array_equal(again.val_document_starts, corpus.val_document_starts)


@pytest.mark.parametrize("val_fraction", [0.01, 0.9, 0.99])
def test_a_two_character_file_keeps_a_character_on_each_side(tmp_path, val_fraction):
    """A fraction that rounds to the whole text (or to nothing) still leaves both splits one
    character; before, an empty training split failed as an unreadable cache."""
    corpus = load_corpus(write(tmp_path / "ab.txt", "ab"), val_fraction=val_fraction, cache_dir=tmp_path / "cache")
    assert decode_all(corpus, "train") == "a" and decode_all(corpus, "val") == "b"


def test_single_document_has_one_start_per_split(tmp_path):
    corpus = load_corpus(write(tmp_path / "one.py", DOCS["a.py"] * 5), cache_dir=tmp_path / "cache")
    assert corpus.train_document_starts.tolist() == [0] and corpus.val_document_starts.tolist() == [0]


def test_cache_without_document_starts_is_rebuilt(tmp_path, monkeypatch):
    for rel, text in DOCS.items():
        write(tmp_path / "corpus" / rel, text)
    cache = tmp_path / "cache"
    first = load_corpus(tmp_path / "corpus", val_fraction=0.5, cache_dir=cache)
    calls = []
    real_encode = ByteTokenizer.encode_array

    def counting(self, text):
        calls.append(len(text))
        return real_encode(self, text)

    monkeypatch.setattr(ByteTokenizer, "encode_array", counting)
    # A cache written before document starts were recorded: an older format tag and no *_docs.bin.
    meta = json.loads((first.path / "meta.json").read_text())
    (first.path / "meta.json").write_text(json.dumps({**meta, "format": "structured-attention-corpus-v1"}))
    for split in ("train", "val"):
        (first.path / f"{split}_docs.bin").unlink()
    old = load_corpus(tmp_path / "corpus", val_fraction=0.5, cache_dir=cache)
    assert calls and old.path == first.path and sorted(p.name for p in old.path.iterdir()) == SHARD_FILES
    assert np.array_equal(old.train_document_starts, first.train_document_starts)
    assert json.loads((old.path / "meta.json").read_text())["format"] == meta["format"]
    # The current format with a document-starts file missing or cut short is rebuilt too.
    for damage in ("unlink", "truncate"):
        calls.clear()
        path = old.path / "val_docs.bin"
        path.unlink() if damage == "unlink" else path.write_bytes(path.read_bytes()[:-8])
        rebuilt = load_corpus(tmp_path / "corpus", val_fraction=0.5, cache_dir=cache)
        assert calls and np.array_equal(rebuilt.val_document_starts, first.val_document_starts)
    calls.clear()
    load_corpus(tmp_path / "corpus", val_fraction=0.5, cache_dir=cache)
    assert not calls  # intact: read, not tokenised


# --------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------


def test_cache_reuses_shards_and_content_changes_hash(tmp_path, monkeypatch):
    make_folder(tmp_path / "corpus")
    cache = tmp_path / "cache"
    first = load_corpus(tmp_path / "corpus", tokenizer="char", cache_dir=cache)
    assert first.path.parent == cache and len(first.path.name) == 64
    assert sorted(p.name for p in first.path.iterdir()) == SHARD_FILES
    meta = json.loads((first.path / "meta.json").read_text())
    assert meta["train_tokens"] == len(first.train) and meta["val_bytes"] == first.val_bytes
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.path.iterdir()}

    def fail(*args, **kwargs):
        raise AssertionError("tokenised again instead of reusing the cached shards")

    monkeypatch.setattr(CharTokenizer, "encode_array", fail)
    monkeypatch.setattr(CharTokenizer, "from_text", fail)
    again = load_corpus(tmp_path / "corpus", tokenizer="char", cache_dir=cache)
    assert again.path == first.path and np.array_equal(again.train, first.train)
    assert again.tokenizer == first.tokenizer
    assert {p.name: p.stat().st_mtime_ns for p in again.path.iterdir()} == mtimes
    monkeypatch.undo()

    # The byte tokenizer gets its own shards; so does a changed file.
    as_bytes = load_corpus(tmp_path / "corpus", tokenizer="byte", cache_dir=cache)
    assert as_bytes.path != first.path
    write(tmp_path / "corpus" / "d0" / "file_00.txt", "changed\n")
    changed = load_corpus(tmp_path / "corpus", tokenizer="char", cache_dir=cache)
    assert changed.path not in (first.path, as_bytes.path)
    assert len(list(cache.iterdir())) == 3


def test_the_same_text_in_other_documents_gets_its_own_document_starts(tmp_path):
    """Two files joined give the text one file holds: the cache told them apart by text alone, so
    the one file got the two files' document starts (a packed run reset attention inside it)."""
    for name in ("a", "b", "c", "d"):
        write(tmp_path / "split" / f"{name}.txt", f"document {name}")
    split = load_corpus(tmp_path / "split", tokenizer="byte", cache_dir=tmp_path / "cache")
    merged_text = decode_all(split, "train")  # the training documents joined, as the corpus joins them
    for name in split.meta["val_documents"]:
        write(tmp_path / "merged" / name, (tmp_path / "split" / name).read_text())
    write(tmp_path / "merged" / "train.txt", merged_text)
    merged = load_corpus(tmp_path / "merged", tokenizer="byte", cache_dir=tmp_path / "cache")
    assert merged.meta["train_documents"] == ["train.txt"]  # the split puts the one file on the training side
    assert decode_all(merged, "train") == decode_all(split, "train")  # the same text, one document
    assert len(split.train_document_starts) > 1 and merged.train_document_starts.tolist() == [0]
    fresh = load_corpus(tmp_path / "merged", tokenizer="byte", cache_dir=tmp_path / "fresh")
    assert merged.path != split.path
    assert np.array_equal(merged.train_document_starts, fresh.train_document_starts)
    assert np.array_equal(merged.val_document_starts, fresh.val_document_starts)


def test_a_cache_inside_the_source_folder_is_not_read_as_text(tmp_path):
    """The corpus cache inside a folder source: its shards are left out (they were read back as
    documents, the corpus growing on every run); a source inside the cache is refused."""
    make_folder(tmp_path / "corpus")
    first = load_corpus(tmp_path / "corpus", tokenizer="byte", cache_dir=tmp_path / "corpus" / "cache")
    again = load_corpus(tmp_path / "corpus", tokenizer="byte", cache_dir=tmp_path / "corpus" / "cache")
    assert again.path == first.path and np.array_equal(again.train, first.train)
    assert not any(n.startswith("cache/") for n in again.meta["train_documents"] + again.meta["val_documents"])
    with pytest.raises(ValueError, match=r"^cache_dir: expected a folder outside the source"):
        load_corpus(tmp_path / "corpus", tokenizer="byte", cache_dir=tmp_path)


def test_decode_takes_one_row_of_a_tensor_or_array_and_refuses_several():
    tok = ByteTokenizer()
    assert tok.decode(torch.tensor([[104, 105]])) == tok.decode(np.array([[104, 105]])) == "hi"  # generate's (1, T)
    with pytest.raises(ValueError, match=r"^ids: expected one sequence of token ids .* got 'shape \(2, 1\)'"):
        tok.decode(torch.tensor([[104], [105]]))


def test_default_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SATTN_CACHE_DIR", str(tmp_path / "envcache"))
    corpus = load_corpus(write(tmp_path / "t.txt", "some text here\n" * 5))
    assert corpus.path.parent == tmp_path / "envcache"


def test_atomic_write_leaves_no_temp_files(tmp_path, monkeypatch):
    path = write(tmp_path / "t.txt", "atomic writes only\n" * 20)
    cache = tmp_path / "cache"
    real_replace = os.replace

    def crash_on_meta(src, dst):
        if str(dst).endswith("meta.json"):
            raise OSError("simulated crash while committing")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_meta)
    with pytest.raises(OSError, match="simulated crash"):
        load_corpus(path, cache_dir=cache)
    monkeypatch.undo()
    (folder,) = cache.iterdir()
    assert not (folder / "meta.json").exists()  # not committed, so never read as a cache hit
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp")]

    corpus = load_corpus(path, cache_dir=cache)  # the next call rebuilds
    assert corpus.path == folder and decode_all(corpus, "val")
    assert sorted(p.name for p in folder.iterdir()) == SHARD_FILES

    # A truncated shard (e.g. written by a foreign process) is detected and rebuilt.
    (folder / "train.bin").write_bytes(b"xx")
    rebuilt = load_corpus(path, cache_dir=cache)
    assert len(rebuilt.train) == corpus.meta["train_tokens"]
    # So is a shard of the right size with one byte changed (its checksum fails).
    expected = np.array(rebuilt.train)
    damaged = bytearray((folder / "train.bin").read_bytes())
    damaged[5] ^= 0x01
    (folder / "train.bin").write_bytes(bytes(damaged))
    assert np.array_equal(np.array(load_corpus(path, cache_dir=cache).train), expected)
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp")]


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def test_load_corpus_errors(tmp_path):
    cache = tmp_path / "cache"
    good = write(tmp_path / "t.txt", "enough text\n" * 10)
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt") as info:
        load_corpus(missing, cache_dir=cache)
    assert "\n" not in str(info.value) and str(info.value).startswith("source")
    for bad in (0, 1, 0.0, 1.0, -0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match=r"^val_fraction"):
            load_corpus(good, val_fraction=bad, cache_dir=cache)
    with pytest.raises(ValueError, match=r"^tokenizer.*'byte'.*'char'"):
        load_corpus(good, tokenizer="bpe", cache_dir=cache)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^source"):
        load_corpus(tmp_path / "empty", cache_dir=cache)
    write(tmp_path / "bin" / "a.bin", b"\x00\x01")
    with pytest.raises(ValueError, match=r"^source"):
        load_corpus(tmp_path / "bin", cache_dir=cache)
    with pytest.raises(ValueError, match=r"^source"):
        load_corpus(write(tmp_path / "e.txt", ""), cache_dir=cache)
    with pytest.raises(ValueError, match=r"^source"):
        load_corpus(12, cache_dir=cache)
    assert not cache.exists()  # nothing was written for a failed load


def test_hf_source_without_datasets_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"structured-attention\[hf\]"):
        load_corpus("hf:wikitext:wikitext-2-raw-v1:train", cache_dir=tmp_path)


@pytest.mark.skipif(not HAVE_DATASETS, reason="the optional 'datasets' package is not installed")
def test_hf_in_memory_dataset(tmp_path):
    import datasets

    records = [f"record {i} ✓\n" * (i % 4 + 1) for i in range(40)] + [""]
    ds = datasets.Dataset.from_dict({"body": records, "id": list(range(41))})
    corpus = load_corpus(ds, text_column="body", val_fraction=0.2, cache_dir=tmp_path)
    names = [str(i) for i in range(40)]
    is_val = split_documents(names, 0.2)
    assert decode_all(corpus, "train") == DOC_SEPARATOR.join(r for r, v in zip(records, is_val) if not v)
    assert decode_all(corpus, "val") == DOC_SEPARATOR.join(r for r, v in zip(records, is_val) if v)
    with pytest.raises(ValueError, match=r"^text_column"):
        load_corpus(ds, cache_dir=tmp_path)


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------

TOKENS = np.arange(1000, dtype=np.uint16) % 997


def test_sample_batch_deterministic_shifted_and_in_range():
    x, y = sample_batch(TOKENS, 8, 16, seed=3, step=5)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.long
    x2, y2 = sample_batch(TOKENS, 8, 16, seed=3, step=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is a real window of the tokens with y the next tokens
    tokens = torch.from_numpy(TOKENS.astype(np.int64))
    for row_x, row_y in zip(x, y):
        i = int(row_x[0])  # TOKENS[i] == i for i < 997
        assert torch.equal(row_x, tokens[i : i + 16]) and torch.equal(row_y, tokens[i + 1 : i + 17])
    assert not torch.equal(x, sample_batch(TOKENS, 8, 16, seed=3, step=6)[0])
    assert not torch.equal(x, sample_batch(TOKENS, 8, 16, seed=4, step=5)[0])


def test_sample_batch_covers_every_start_including_the_last():
    tokens = np.arange(12, dtype=np.uint8)
    x, y = sample_batch(tokens, 500, 4, seed=0, step=0)
    assert set(x[:, 0].tolist()) == set(range(12 - 4))  # starts 0..7; y of start 7 ends at 11
    assert int(y.max()) == 11
    x, y = sample_batch(tokens, 3, 11, seed=0, step=0)  # the only window
    assert torch.equal(x[0], torch.arange(11)) and torch.equal(y[0], torch.arange(1, 12))


def test_sample_batch_world_size_union():
    B, W = 3, 4
    whole_x, whole_y = sample_batch(TOKENS, B * W, 10, seed=7, step=11)
    parts = [sample_batch(TOKENS, B, 10, seed=7, step=11, rank=r, world_size=W) for r in range(W)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), whole_y)
    assert not torch.equal(parts[0][0], parts[1][0])


def test_sample_batch_works_on_memmap(tmp_path):
    corpus = load_corpus(write(tmp_path / "t.txt", "memory mapped tokens\n" * 30), cache_dir=tmp_path / "c")
    x, y = sample_batch(corpus.train, 4, 8, seed=0, step=0, device=torch.device("cpu"))
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    text = corpus.tokenizer.decode(x[0])
    assert text in decode_all(corpus, "train")


def test_eval_batches_consecutive_windows():
    tokens = np.arange(103, dtype=np.uint8)
    batches = list(eval_batches(tokens, 4, 10))
    n_windows = (103 - 1) // 10
    assert [b[0].shape[0] for b in batches] == [4, 4, 2] and sum(b[0].shape[0] for b in batches) == n_windows
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert torch.equal(x.flatten(), torch.arange(100)) and torch.equal(y.flatten(), torch.arange(1, 101))
    assert x.dtype == torch.long
    assert len(list(eval_batches(tokens, 4, 10, max_batches=2))) == 2
    again = list(eval_batches(tokens, 4, 10))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    (only,) = eval_batches(np.arange(11, dtype=np.uint8), 8, 10)
    assert only[0].shape == (1, 10)


def token_documents(corpus: Corpus, split: str) -> np.ndarray:
    """For each token of a byte-tokenised ``split``: its document's index, from the file texts."""
    names = corpus.meta[f"{split}_documents"]
    sizes = [len(DOCS[n].encode()) + len(DOC_SEPARATOR) for n in names[:-1]] + [len(DOCS[names[-1]].encode())]
    return np.repeat(np.arange(len(names)), sizes)


def test_document_ids_of_sampled_and_eval_windows(tmp_path):
    for rel, text in DOCS.items():
        write(tmp_path / "corpus" / rel, text)
    corpus = load_corpus(tmp_path / "corpus", val_fraction=0.5, cache_dir=tmp_path / "cache")
    for split in ("train", "val"):
        tokens, starts = getattr(corpus, split), getattr(corpus, f"{split}_document_starts")
        expected = token_documents(corpus, split)
        assert len(expected) == len(tokens)
        # Token ids equal to their own positions make x say which token each id is for.
        positions = np.arange(len(tokens))
        x, y, ids = sample_batch(positions, 64, 16, seed=1, step=2, document_starts=starts)
        assert ids.dtype == torch.long and ids.shape == x.shape == (64, 16)
        assert np.array_equal(ids.numpy(), expected[x.numpy()])
        assert bool((ids[:, -1] > ids[:, 0]).any())  # some windows cross a boundary
        # The same windows as without document starts: (x, y) is unchanged, a pure function of (seed, step).
        x0, y0 = sample_batch(tokens, 64, 16, seed=1, step=2)
        x1, y1, ids1 = sample_batch(tokens, 64, 16, seed=1, step=2, document_starts=starts)
        assert torch.equal(x0, x1) and torch.equal(y0, y1) and torch.equal(ids1, ids)
        parts = [sample_batch(tokens, 16, 16, seed=1, step=2, rank=r, world_size=4, document_starts=starts)
                 for r in range(4)]
        assert torch.equal(torch.cat([p[2] for p in parts]), ids)
        for (xp, yp, idsp), (xe, ye) in zip(eval_batches(positions, 3, 10, document_starts=starts),
                                            eval_batches(tokens, 3, 10)):
            assert np.array_equal(idsp.numpy(), expected[xp.numpy()])
            assert torch.equal(xe, torch.from_numpy(np.asarray(tokens, dtype=np.int64)[xp.numpy()]))
    assert np.array_equal(document_ids(np.array([0, 3, 5]), np.array([0, 4]), 3), [[0, 0, 0], [1, 2, 2]])


def test_batch_errors_name_parameter():
    short = np.arange(10, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"^seq_len"):
        sample_batch(short, 2, 10, seed=0, step=0)
    with pytest.raises(ValueError, match=r"^seq_len"):
        eval_batches(short, 2, 10)
    with pytest.raises(ValueError, match=r"^seq_len"):
        sample_batch(short, 2, 0, seed=0, step=0)
    with pytest.raises(ValueError, match=r"^batch_size"):
        sample_batch(short, 0, 4, seed=0, step=0)
    with pytest.raises(ValueError, match=r"^rank"):
        sample_batch(short, 2, 4, seed=0, step=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"^world_size"):
        sample_batch(short, 2, 4, seed=0, step=0, world_size=0)
    with pytest.raises(ValueError, match=r"^seed"):
        sample_batch(short, 2, 4, seed=-1, step=0)
    with pytest.raises(ValueError, match=r"^step"):
        sample_batch(short, 2, 4, seed=0, step=-1)
    with pytest.raises(ValueError, match=r"^max_batches"):
        eval_batches(short, 2, 4, max_batches=0)
    with pytest.raises(ValueError, match=r"^tokens"):
        sample_batch(np.zeros((2, 20)), 2, 4, seed=0, step=0)
    for bad in (np.array([1, 4]), np.array([0, 4, 4]), np.array([0, 10]), np.array([], dtype=np.int64),
                np.array([0.0, 4.0]), [0, 4]):
        with pytest.raises(ValueError, match=r"^document_starts: expected [^\n]*$"):
            sample_batch(short, 2, 4, seed=0, step=0, document_starts=bad)
        with pytest.raises(ValueError, match=r"^document_starts"):
            eval_batches(short, 2, 4, document_starts=bad)
