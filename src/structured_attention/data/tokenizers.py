"""Tokenizers for the language-modelling data layer.

Two tokenizers, both exact and serialisable to a JSON-able ``dict``:

- :class:`ByteTokenizer` (``name = "byte"``): the UTF-8 bytes of the text, vocabulary 256.
- :class:`CharTokenizer` (``name = "char"``): one id per Unicode character. The vocabulary is the
  sorted (by code point) distinct characters of the *training* text; id ``0`` is reserved for
  ``<unk>`` (any character not in the vocabulary, e.g. one seen only in validation) and the
  known characters take ids ``1 .. vocab_size - 1`` in sorted order. ``decode`` writes ``<unk>``
  as U+FFFD (the replacement character), as the byte tokenizer does for invalid UTF-8.

- :class:`HFTokenizer` (``"hf:PATH"``): a Hugging Face ``tokenizers`` tokenizer read from a local
  ``tokenizer.json`` (PATH is the file or the folder holding it; nothing is downloaded). Its
  ``name`` is ``hf:`` and a hash of the file, so corpora cached with one tokenizer are never read
  with another. Subword tokenizers are not context-free: a corpus encodes each document alone.

:func:`tokenizer_from_json` rebuilds any of them from its ``to_json()`` dict.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .._checks import require

__all__ = ["ByteTokenizer", "CharTokenizer", "HFTokenizer", "Tokenizer", "TOKENIZERS", "tokenizer_from_json"]

#: The tokenizer names :func:`structured_attention.data.load_corpus` accepts (and ``"hf:PATH"``).
TOKENIZERS = ("byte", "char")

_REPLACEMENT = "\ufffd"


def _as_int_list(ids: Iterable[int] | np.ndarray) -> list[int]:
    """The ids of one sequence as ints: a list, a 1-D array or tensor, or one row of a 2-D one
    (``GPT.generate``'s ``(1, T)`` output); several rows are refused (which would they be?)."""
    if hasattr(ids, "shape") and hasattr(ids, "tolist"):  # NumPy arrays and torch tensors alike
        shape = tuple(ids.shape)  # type: ignore[union-attr]
        require(len(shape) <= 1 or all(n == 1 for n in shape[:-1]), "ids",
                "one sequence of token ids (a 1-D array, or a 2-D one of one row)", f"shape {shape}")
        values = ids.tolist()  # type: ignore[union-attr]
        for _ in shape[:-1]:
            values = values[0]
        return [int(v) for v in ([values] if not shape else values)]
    return [int(i) for i in ids]


class ByteTokenizer:
    """UTF-8 bytes: ``encode`` gives ids in ``[0, 256)``; ``decode`` uses ``errors='replace'``."""

    name = "byte"
    vocab_size = 256
    dtype = np.uint8
    context_free = True  # a text's tokens are its parts' tokens, joined

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as a ``np.uint8`` array (fast path used for whole corpora)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        values = _as_int_list(ids)
        require(all(0 <= v < 256 for v in values), "ids", "byte ids in [0, 256)", values[:8])
        return bytes(values).decode("utf-8", errors="replace")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ByteTokenizer:
        require(isinstance(d, dict) and d.get("name") == cls.name, "d", "a dict with name='byte'", d)
        return cls()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class CharTokenizer:
    """One id per character; id 0 is ``<unk>``, ids ``1..`` the sorted vocabulary characters.

    Build it from text with :meth:`from_text` (the sorted distinct characters) or directly from a
    string/iterable of distinct characters: ``CharTokenizer("abc")``.
    """

    name = "char"
    unk_id = 0
    unk_token = "<unk>"
    context_free = True

    def __init__(self, chars: Iterable[str]):
        chars = list(chars)
        require(all(isinstance(c, str) and len(c) == 1 for c in chars), "chars", "single characters", chars[:8])
        require(len(set(chars)) == len(chars), "chars", "distinct characters", "".join(chars)[:40])
        self.chars: tuple[str, ...] = tuple(sorted(chars))
        self._codepoints = np.array([ord(c) for c in self.chars], dtype=np.uint32)
        self._index = {c: i + 1 for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars) + 1
        self.dtype = np.uint16 if self.vocab_size <= 65536 else np.uint32

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokenizer whose vocabulary is the sorted distinct characters of ``text``."""
        return cls(set(text))

    def encode(self, text: str) -> list[int]:
        return [self._index.get(c, self.unk_id) for c in text]

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an array of ``self.dtype`` (vectorised; used for whole corpora)."""
        cps = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
        if len(self._codepoints) == 0:
            return np.zeros(len(cps), dtype=self.dtype)
        pos = np.searchsorted(self._codepoints, cps)
        clipped = np.minimum(pos, len(self._codepoints) - 1)
        found = self._codepoints[clipped] == cps
        return np.where(found, pos + 1, self.unk_id).astype(self.dtype)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        values = _as_int_list(ids)
        n = self.vocab_size
        require(all(0 <= v < n for v in values), "ids", f"char ids in [0, {n})", values[:8])
        chars = self.chars
        return "".join(_REPLACEMENT if v == 0 else chars[v - 1] for v in values)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "unk_id": self.unk_id,
            "chars": "".join(self.chars),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CharTokenizer:
        require(
            isinstance(d, dict) and d.get("name") == cls.name and isinstance(d.get("chars"), str),
            "d",
            "a dict with name='char' and a 'chars' string",
            d if not isinstance(d, dict) else {k: d[k] for k in list(d)[:3]},
        )
        return cls(d["chars"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    def __hash__(self) -> int:
        return hash((self.name, self.chars))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (its ``tokenizer.json`` text in ``spec``); special
    tokens are neither added nor skipped."""

    context_free = False

    def __init__(self, spec: str) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:
            raise ImportError("tokenizer: 'hf:PATH' needs the 'tokenizers' package: pip install "
                              "'structured-attention[hf]'") from e
        try:
            self._tokenizer = _Tokenizer.from_str(spec)
        except Exception as e:  # tokenizers raises its own exception type for a malformed file
            raise ValueError(f"tokenizer: expected a tokenizers tokenizer.json, got one it cannot read ({e})") from None
        self.spec = spec
        self.name = "hf:" + hashlib.sha256(spec.encode("utf-8")).hexdigest()[:16]
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.dtype = np.uint16 if self.vocab_size <= 65536 else np.uint32

    @classmethod
    def from_path(cls, path: str) -> HFTokenizer:
        """From ``tokenizer.json`` or the folder holding it (a saved Hugging Face tokenizer)."""
        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer: no tokenizer.json at {str(p)!r} (expected 'hf:' and a local "
                                    f"tokenizer folder or file)")
        return cls(file.read_text(encoding="utf-8"))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=self.dtype)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        values = _as_int_list(ids)
        n = self.vocab_size
        require(all(0 <= v < n for v in values), "ids", f"token ids in [0, {n})", values[:8])
        return self._tokenizer.decode(values, skip_special_tokens=False)

    def to_json(self) -> dict[str, Any]:
        return {"name": "hf", "vocab_size": self.vocab_size, "spec": self.spec}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HFTokenizer:
        require(isinstance(d, dict) and d.get("name") == "hf" and isinstance(d.get("spec"), str), "d",
                "a dict with name='hf' and a 'spec' string", d if not isinstance(d, dict) else sorted(d))
        return cls(d["spec"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFTokenizer) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name}, vocab_size={self.vocab_size})"


Tokenizer = ByteTokenizer | CharTokenizer | HFTokenizer


def tokenizer_from_json(d: dict[str, Any]) -> Tokenizer:
    """Rebuild a tokenizer from its ``to_json()`` dict (``name`` is ``"byte"``, ``"char"`` or ``"hf"``)."""
    name = d.get("name") if isinstance(d, dict) else None
    require(name in (*TOKENIZERS, "hf"), "d['name']", "one of 'byte', 'char', 'hf'", name)
    if name == "hf":
        return HFTokenizer.from_json(d)
    return ByteTokenizer.from_json(d) if name == "byte" else CharTokenizer.from_json(d)
