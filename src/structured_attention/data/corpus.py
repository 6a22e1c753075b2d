"""Text corpora for language modelling, tokenised once into cached memory-mapped shards.

:func:`load_corpus` reads a source, splits it into train and validation text, tokenises both once
and returns a :class:`Corpus` whose ``train`` / ``val`` are read-only 1-D ``np.memmap``\\ s and
whose ``train_document_starts`` / ``val_document_starts`` say where each document begins in them.

Sources
-------
- ``None`` or ``"stdlib"``: the embedded default corpus, the running interpreter's standard
  library source (``sysconfig.get_paths()["stdlib"]``): every ``*.py`` file, in sorted
  relative-path order, except those under a folder named ``test``, ``tests``, ``idle_test``,
  ``site-packages``, ``dist-packages``, ``__pycache__`` or ``config-*`` and the machine-generated
  ``_sysconfigdata_*.py`` (about 12-13 MB for CPython 3.11). See :func:`stdlib_files`.
- a path to a text file, or to a folder: every file under it (sorted by relative path, hidden
  files and folders -- names starting with ``.`` -- skipped, and the cache folder when it lies
  inside; a folder inside the cache is refused) that holds no NUL byte; binaries are skipped.
  Files are decoded as UTF-8 with ``errors="replace"``; empty files are skipped, and so are files
  a subword tokenizer encodes to no tokens (whitespace, to a word-level one).
- ``"hf:NAME[:CONFIG][:SPLIT]"`` (``SPLIT`` defaults to ``train``) or an in-memory
  ``datasets.Dataset``: the records' ``text_column``; needs the optional ``datasets`` package.

Split rule (deterministic, documented in one place: :func:`split_documents`)
----------------------------------------------------------------------------
With two or more documents (files, or dataset records), the split is *by document*: a document
goes to validation iff ``u < val_fraction`` where
``u = int(sha256(name.encode()).hexdigest()[:16], 16) / 2**64`` and ``name`` is the file's
relative POSIX path (for dataset records: the record index as a decimal string). So a file's side
never depends on which other files exist. Both sides are kept non-empty: if no document falls in
validation, the one with the smallest ``u`` goes there; if all do, the one with the largest ``u``
stays in training. ``val_fraction`` is thus the expected fraction of *documents*, not of bytes.
Within each side, documents keep their sorted order and are joined with :data:`DOC_SEPARATOR`
(``"\\n\\n"``, i.e. one blank line). A single document is split by characters: the last
``max(1, round(val_fraction * n_chars))`` characters are validation, the rest training.

Document boundaries
-------------------
``"\\n\\n"`` also occurs inside documents (blank lines in Python files), so the boundaries
cannot be found in the tokens afterwards; they are recorded while tokenising. For each split, an
``int64`` array holds the token index where each document starts: the first is 0, and the
separator's tokens belong to the document before it. A single-document corpus has one document
per split (start 0). ``byte`` (one token per UTF-8 byte) and ``char`` (one per code point) are
context-free, so a document's token count is that of its text encoded alone; the counts are
checked to add up to the split's tokens. A subword tokenizer (``hf:PATH``) is not: each document
is encoded alone and the pieces joined with the separator's tokens, so the starts are exact. ``data.pack_documents``
(:mod:`structured_attention.experiments.lm`) uses the starts to reset attention and positions at
each document's first token.

Cache
-----
Shards live in ``<cache_dir>/<key>/`` with ``key = sha256`` of (a format tag, the tokenizer name,
the UTF-8 train text, the UTF-8 validation text, each split's document names and lengths: the
same text split into other documents has other document starts), each length-prefixed: ``train.bin``,
``val.bin`` (raw ``np.uint8`` ids for ``byte``, ``np.uint16`` for ``char`` with a vocabulary up to
65536, else ``np.uint32``), ``train_docs.bin`` and ``val_docs.bin`` (the document starts, raw
``np.int64``, one per document name in ``meta.json``) and ``meta.json`` (format tag, tokenizer
json, token counts, byte counts, dtype, source description, document names, and the SHA-256 of
the four other files). Every file is written to a temporary file in the same folder and moved
into place with ``os.replace``; ``meta.json`` is written last and is the commit marker, so an
interrupted write never yields a shard that is read. A folder whose ``meta.json`` names another
format (e.g. one written before document starts were recorded), or whose shards or document
starts are missing, truncated or fail their checksum, is rebuilt (hashing costs one read of the
shards per load, about a second per GB). A second call with the same content (same split, same tokenizer) reads the shards
without tokenising. The default ``cache_dir`` is ``$SATTN_CACHE_DIR`` or
``~/.cache/structured-attention``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._checks import require
from .._files import atomic_write, file_sha256
from .tokenizers import TOKENIZERS, ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer, tokenizer_from_json

__all__ = [
    "Corpus",
    "DOC_SEPARATOR",
    "default_cache_dir",
    "load_corpus",
    "split_documents",
    "stdlib_files",
]

#: Joins the documents of one split.
DOC_SEPARATOR = "\n\n"
#: Folder names excluded from the stdlib corpus (besides any ``config-*`` folder).
STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_FORMAT = "structured-attention-corpus-v3"  # v2: document starts; v3: the files' SHA-256 in meta.json
_SHARDS = ("train.bin", "val.bin", "train_docs.bin", "val_docs.bin")
_HF_EXTRA = "pip install 'structured-attention[hf]'"


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------


@dataclass
class Corpus:
    """A tokenised train/validation split.

    ``train`` and ``val`` are read-only 1-D ``np.memmap`` arrays of token ids; ``train_bytes`` and
    ``val_bytes`` the UTF-8 byte counts of the text they encode; ``train_document_starts`` and
    ``val_document_starts`` read-only ``int64`` arrays of the token index where each document of the
    split starts (increasing, the first 0; see the module docstring); ``path`` the cache folder
    holding the shards and ``meta`` the contents of its ``meta.json``.
    """

    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    source: str
    train_bytes: int
    val_bytes: int
    train_document_starts: np.ndarray
    val_document_starts: np.ndarray
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def val_bytes_per_token(self) -> float:
        """``val_bytes / len(val)``: UTF-8 bytes per validation token (1.0 for ``byte``)."""
        return self.val_bytes / len(self.val)

    def bits_per_byte(self, nats_per_token: float) -> float:
        """Bits per UTF-8 byte from a mean validation loss in nats per token:

        ``bits_per_byte = nats_per_token / ln(2) / val_bytes_per_token``.

        Exact when the mean is over the whole validation split; over a prefix of it (e.g. a capped
        number of eval batches) it assumes that prefix has the split's bytes per token.
        """
        return float(nats_per_token) / math.log(2) / self.val_bytes_per_token

    def __repr__(self) -> str:
        return (
            f"Corpus(source={self.source!r}, tokenizer={self.tokenizer!r}, train={len(self.train)} tokens, "
            f"val={len(self.val)} tokens, train_bytes={self.train_bytes}, val_bytes={self.val_bytes}, "
            f"train_documents={len(self.train_document_starts)}, val_documents={len(self.val_document_starts)})"
        )


def default_cache_dir() -> Path:
    """``$SATTN_CACHE_DIR`` if set, else ``~/.cache/structured-attention``."""
    env = os.environ.get("SATTN_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "structured-attention"


# --------------------------------------------------------------------------------------------------
# Splitting
# --------------------------------------------------------------------------------------------------


def _bucket(name: str) -> float:
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest()[:16], 16) / 2**64


def split_documents(names: Sequence[str], val_fraction: float) -> list[bool]:
    """For each document name, whether it goes to validation (the rule in the module docstring).

    Needs at least two names; both sides come out non-empty.
    """
    require(len(names) >= 2, "names", "at least two documents", len(names))
    u = [_bucket(n) for n in names]
    is_val = [x < val_fraction for x in u]
    if not any(is_val):
        is_val[min(range(len(u)), key=u.__getitem__)] = True
    if all(is_val):
        is_val[max(range(len(u)), key=u.__getitem__)] = False
    return is_val


def _split(
    names: list[str], texts: list[str], val_fraction: float
) -> tuple[list[str], list[str], list[str], list[str]]:
    """(train documents, validation documents, train names, validation names) from non-empty
    documents; each side's text is its documents joined with :data:`DOC_SEPARATOR`."""
    if len(texts) == 1:
        text = texts[0]
        n_val = min(len(text) - 1, max(1, round(val_fraction * len(text))))  # both sides non-empty
        cut = len(text) - n_val
        return [text[:cut]], [text[cut:]], list(names), list(names)
    is_val = split_documents(names, val_fraction)
    return (
        [t for t, v in zip(texts, is_val) if not v],
        [t for t, v in zip(texts, is_val) if v],
        [n for n, v in zip(names, is_val) if not v],
        [n for n, v in zip(names, is_val) if v],
    )


def _document_starts(tok: Tokenizer, documents: list[str], n_tokens: int, split: str) -> np.ndarray:
    """The token index where each of ``documents`` starts in their tokenised join (int64)."""
    # Context-free tokenizers: the join's tokens are each document's tokens, then the separator's.
    counts = np.array([len(tok.encode_array(d)) for d in documents], dtype=np.int64)
    counts[:-1] += len(tok.encode_array(DOC_SEPARATOR))
    total = int(counts.sum())
    require(total == n_tokens, "tokenizer", f"a context-free tokenizer (the {split} documents' token counts "
            f"summing to the split's {n_tokens} tokens)", f"{tok.name} with a sum of {total}")
    return np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64)


def _encode_each(tok: Tokenizer, documents: list[str], names: list[str], split: str
                 ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """A subword tokenizer's tokens of ``documents`` joined by the separator, each encoded alone
    (a document's tokens do not depend on its neighbours), where each starts, and the names of the
    documents kept: one that encodes to no tokens (whitespace, to some tokenizers) is left out."""
    separator = tok.encode_array(DOC_SEPARATOR)
    encoded = [(tok.encode_array(d), n) for d, n in zip(documents, names)]
    encoded = [(ids, n) for ids, n in encoded if len(ids)]
    require(len(encoded) > 0, "source", f"text that {tok.name} encodes to tokens in the {split} split",
            f"{len(documents)} document(s) of no tokens")
    pieces = [piece for i, (ids, _) in enumerate(encoded) for piece in ((separator, ids) if i else (ids,))]
    lengths = np.array([len(ids) for ids, _ in encoded], dtype=np.int64) + len(separator)
    starts = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)
    return np.concatenate(pieces).astype(tok.dtype), starts, [n for _, n in encoded]


# --------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------


def stdlib_files(root: str | os.PathLike | None = None) -> list[str]:
    """The relative POSIX paths (sorted) of the stdlib ``*.py`` files in the default corpus."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS and not d.startswith("config-")]
        for f in filenames:
            if f.endswith(".py") and not f.startswith("_sysconfigdata_"):
                out.append((Path(dirpath) / f).relative_to(root).as_posix())
    return sorted(out)


def _read_text(path: Path) -> str | None:
    """The file's text (UTF-8, errors replaced), or None when it holds a NUL byte (binary)."""
    data = path.read_bytes()
    if b"\x00" in data:
        return None
    return data.decode("utf-8", errors="replace")


def _read_files(root: Path, rels: list[str]) -> tuple[list[str], list[str]]:
    names, texts = [], []
    for rel in rels:
        text = _read_text(root / rel)
        if text:  # skips binaries (None) and empty files
            names.append(rel)
            texts.append(text)
    return names, texts


def _folder_files(root: Path, skip: Path | None = None) -> list[str]:
    """The files of a folder source, hidden ones and the folder ``skip`` (the corpus cache, when it
    lies inside the source: its shards would be read back as text, more on every run) left out."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and (Path(dirpath) / d).resolve() != skip]
        for f in filenames:
            p = Path(dirpath) / f
            if not f.startswith(".") and p.is_file():
                out.append(p.relative_to(root).as_posix())
    return sorted(out)


def _import_datasets():
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError as e:
        raise ImportError(
            f"source: Hugging Face datasets need the optional 'datasets' package: {_HF_EXTRA}"
        ) from e
    return datasets


@contextlib.contextmanager
def _quiet_hub() -> Iterator[None]:
    """The hub's retry warnings off (an unreachable source prints one line per retry); its errors
    still end the load, and become one line naming ``source``."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _is_hf_dataset(obj: object) -> bool:
    mod = sys.modules.get("datasets")
    return mod is not None and isinstance(obj, mod.Dataset)


def _hf_documents(dataset: Any, text_column: str) -> tuple[list[str], list[str]]:
    columns = list(dataset.column_names)
    require(text_column in columns, "text_column", f"a column of the dataset ({', '.join(columns)})", text_column)
    names, texts = [], []
    for i, t in enumerate(dataset[text_column]):
        if t:
            require(isinstance(t, str), "text_column", "a column of strings", type(t).__name__)
            names.append(str(i))
            texts.append(t)
    return names, texts


def _read_source(source: Any, text_column: str, cache: Path | None = None) -> tuple[str, list[str], list[str]]:
    """(description, document names, document texts) of a source; texts are non-empty. A folder
    source is read without the corpus cache folder ``cache``, and refused inside it."""
    if source is None or (isinstance(source, str) and source == "stdlib"):
        root = Path(sysconfig.get_paths()["stdlib"])
        names, texts = _read_files(root, stdlib_files(root))
        v = sys.version_info
        return f"stdlib:{root.as_posix()} (Python {v.major}.{v.minor}.{v.micro})", names, texts
    if isinstance(source, str) and source.startswith("hf:"):
        parts = source[3:].split(":")
        require(
            1 <= len(parts) <= 3 and parts[0] != "", "source", "'hf:NAME[:CONFIG][:SPLIT]'", source
        )
        datasets = _import_datasets()
        name = parts[0]
        config = parts[1] if len(parts) > 1 and parts[1] else None
        split = parts[2] if len(parts) > 2 and parts[2] else "train"
        try:
            with _quiet_hub():
                dataset = datasets.load_dataset(name, config, split=split)
        except Exception as e:  # offline, unknown name, bad config or split: the hub's many error types
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"source: could not load {source!r}: {type(e).__name__}: {first[:200]}") from None
        names, texts = _hf_documents(dataset, text_column)
        return f"hf:{name}:{config or ''}:{split}", names, texts
    if _is_hf_dataset(source):
        names, texts = _hf_documents(source, text_column)
        info = getattr(source, "info", None)
        label = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None) or "in-memory"
        return f"hf-dataset:{label} ({len(source)} records)", names, texts
    require(
        isinstance(source, (str, os.PathLike)),
        "source",
        "None, 'stdlib', a file or folder path, 'hf:NAME[:CONFIG][:SPLIT]' or a datasets.Dataset",
        type(source).__name__,
    )
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"source: no such file or folder: {str(path)!r}")
    if path.is_dir():
        inside = cache is not None and path.resolve().is_relative_to(cache)
        require(not inside, "cache_dir", f"a folder outside the source {str(path)!r} (its shards would be read as "
                "text)", str(cache))
        names, texts = _read_files(path, _folder_files(path, cache))
        return f"folder:{path.resolve().as_posix()}", names, texts
    # A FIFO would block the read forever and a device such as /dev/zero never end it.
    require(path.is_file(), "source", "a regular file or a folder (not a FIFO or a device)", str(path))
    text = _read_text(path)
    texts = [text] if text else []
    return f"file:{path.resolve().as_posix()}", [path.name] * len(texts), texts


# --------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------


def _cache_key(tokenizer_name: str, train_b: bytes, val_b: bytes,
               splits: Sequence[tuple[Sequence[str], Sequence[str]]]) -> str:
    """The shards' folder name: a hash of what they hold, each split's ``(names, documents)``
    names and lengths included (the same text split into other documents has other starts)."""
    h = hashlib.sha256()
    layout = json.dumps([[[n, len(d)] for n, d in zip(names, docs)] for names, docs in splits])
    for part in (_FORMAT.encode(), tokenizer_name.encode(), train_b, val_b, layout.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _tokenizer_key(tokenizer: str | Tokenizer) -> str:
    """What names a tokenizer in the cache key: the spec (``"char"`` builds its vocabulary from the
    training text, so the text decides it), an HF tokenizer's name (a hash of its file), and a given
    character tokenizer's vocabulary."""
    if isinstance(tokenizer, CharTokenizer):
        return "char:" + hashlib.sha256(json.dumps(tokenizer.to_json(), sort_keys=True).encode()).hexdigest()
    return tokenizer if isinstance(tokenizer, str) else tokenizer.name


def _open_shards(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]] | None:
    """The cached (meta, tokens by split, document starts by split) in ``folder``, or None when it
    is absent, incomplete or of another format."""
    tokens, starts = {}, {}
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        if meta.get("format") != _FORMAT:
            return None
        if any(file_sha256(folder / name) != meta["sha256"][name] for name in _SHARDS):
            return None
        dtype = np.dtype(meta["dtype"])
        for split in ("train", "val"):
            n = int(meta[f"{split}_tokens"])
            p = folder / f"{split}.bin"
            if n <= 0 or p.stat().st_size != n * dtype.itemsize:
                return None
            tokens[split] = np.memmap(p, dtype=dtype, mode="r", shape=(n,))
            s = np.fromfile(folder / f"{split}_docs.bin", dtype=np.int64)
            if len(s) != len(meta[f"{split}_documents"]) or s[0] != 0 or np.any(np.diff(s) <= 0) or s[-1] >= n:
                return None
            s.flags.writeable = False
            starts[split] = s
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    return meta, tokens, starts


# --------------------------------------------------------------------------------------------------
# load_corpus
# --------------------------------------------------------------------------------------------------


def load_corpus(
    source: Any = None,
    *,
    tokenizer: str | Tokenizer = "byte",
    val_fraction: float = 0.1,
    cache_dir: str | os.PathLike | None = None,
    text_column: str = "text",
) -> Corpus:
    """Load, split, tokenise (once, cached) and memory-map a text corpus.

    ``source``: ``None``/``"stdlib"`` (the default corpus), a file or folder path,
    ``"hf:NAME[:CONFIG][:SPLIT]"`` or a ``datasets.Dataset``; ``tokenizer``: ``"byte"``,
    ``"char"`` (its vocabulary is built from the training text), ``"hf:PATH"`` (a local
    ``tokenizer.json`` or the folder holding it) or a tokenizer itself (a checkpoint's, to score
    its model on text encoded as it was trained); ``val_fraction`` in ``(0, 1)``.
    See the module docstring for the split rule and the cache layout.

    Raises ``FileNotFoundError`` for a missing path, ``ImportError`` naming the ``[hf]`` extra when a
    Hugging Face source is asked for without ``datasets``, and ``ValueError`` naming the parameter
    for everything else (an empty corpus names ``source``).
    """
    given = tokenizer if isinstance(tokenizer, (ByteTokenizer, CharTokenizer, HFTokenizer)) else None
    hub = isinstance(tokenizer, str) and tokenizer.startswith("hf:") and len(tokenizer) > 3
    require(given is not None or tokenizer in TOKENIZERS or hub, "tokenizer",
            f"one of {', '.join(map(repr, TOKENIZERS))}, 'hf:PATH' (a local tokenizer.json or its folder) or a "
            f"tokenizer", tokenizer)
    hf_tokenizer = HFTokenizer.from_path(tokenizer[3:]) if hub else None
    require(
        isinstance(val_fraction, (int, float)) and not isinstance(val_fraction, bool) and 0 < val_fraction < 1,
        "val_fraction",
        "a number in the open interval (0, 1)",
        val_fraction,
    )
    require(isinstance(text_column, str) and text_column != "", "text_column", "a column name", text_column)

    cache_root = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser()
    description, names, texts = _read_source(source, text_column, cache_root.resolve())
    n_chars = sum(len(t) for t in texts)
    require(
        n_chars >= 2, "source", "a corpus with text (at least 2 characters)", f"{description}: {n_chars} characters"
    )
    train_docs, val_docs, train_names, val_names = _split(names, texts, val_fraction)
    train_text, val_text = DOC_SEPARATOR.join(train_docs), DOC_SEPARATOR.join(val_docs)
    train_b = train_text.encode("utf-8")
    val_b = val_text.encode("utf-8")

    folder = cache_root / _cache_key(_tokenizer_key(given or hf_tokenizer or tokenizer), train_b, val_b,
                                     [(train_names, train_docs), (val_names, val_docs)])
    cached = _open_shards(folder)
    if cached is None:
        tok: Tokenizer = given or hf_tokenizer or (ByteTokenizer() if tokenizer == "byte"
                                                   else CharTokenizer.from_text(train_text))
        if tok.context_free:
            train_ids = tok.encode_array(train_text)
            val_ids = tok.encode_array(val_text)
            train_starts = _document_starts(tok, train_docs, len(train_ids), "train")
            val_starts = _document_starts(tok, val_docs, len(val_ids), "val")
        else:
            train_ids, train_starts, train_names = _encode_each(tok, train_docs, train_names, "train")
            val_ids, val_starts, val_names = _encode_each(tok, val_docs, val_names, "validation")
        meta = {
            "format": _FORMAT,
            "source": description,
            "tokenizer": tok.to_json(),
            "dtype": np.dtype(train_ids.dtype).name,
            "train_tokens": int(len(train_ids)),
            "val_tokens": int(len(val_ids)),
            "train_bytes": len(train_b),
            "val_bytes": len(val_b),
            "val_fraction": val_fraction,
            "train_documents": train_names,
            "val_documents": val_names,
        }
        folder.mkdir(parents=True, exist_ok=True)
        contents = dict(zip(_SHARDS, (train_ids, val_ids, train_starts, val_starts)))
        for name, array in contents.items():
            atomic_write(folder / name, lambda p, a=array: Path(p).write_bytes(a.tobytes()))
        meta["sha256"] = {name: hashlib.sha256(array.tobytes()).hexdigest() for name, array in contents.items()}
        atomic_write(folder / "meta.json", lambda p: Path(p).write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8"))
        cached = _open_shards(folder)
        if cached is None:  # pragma: no cover - only if the filesystem lost what was just written
            raise OSError(f"cache_dir: could not read back the shards written to {str(folder)!r}")
    meta, tokens, starts = cached
    return Corpus(
        train=tokens["train"],
        val=tokens["val"],
        tokenizer=tokenizer_from_json(meta["tokenizer"]),
        source=description,
        train_bytes=int(meta["train_bytes"]),
        val_bytes=int(meta["val_bytes"]),
        train_document_starts=starts["train"],
        val_document_starts=starts["val"],
        path=folder,
        meta=meta,
    )
