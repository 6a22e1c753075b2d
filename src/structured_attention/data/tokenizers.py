"""Tokenizers for the language-modelling data layer.

Two tokenizers, both exact and serialisable to a JSON-able ``dict``:

- :class:`ByteTokenizer` (``name = "byte"``): the UTF-8 bytes of the text, vocabulary 256.
- :class:`CharTokenizer` (``name = "char"``): one id per Unicode character. The vocabulary is the
  sorted (by code point) distinct characters of the *training* text; id ``0`` is reserved for
  ``<unk>`` (any character not in the vocabulary, e.g. one seen only in validation) and the
  known characters take ids ``1 .. vocab_size - 1`` in sorted order. ``decode`` writes ``<unk>``
  as U+FFFD (the replacement character), as the byte tokenizer does for invalid UTF-8.

:func:`tokenizer_from_json` rebuilds either from its ``to_json()`` dict.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .._checks import require

__all__ = ["ByteTokenizer", "CharTokenizer", "Tokenizer", "TOKENIZERS", "tokenizer_from_json"]

#: The tokenizer names :func:`structured_attention.data.load_corpus` accepts.
TOKENIZERS = ("byte", "char")

_REPLACEMENT = "\ufffd"


def _as_int_list(ids: Iterable[int] | np.ndarray) -> list[int]:
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False).ravel().tolist()
    if hasattr(ids, "tolist"):  # torch tensors
        return list(ids.tolist())  # type: ignore[union-attr]
    return [int(i) for i in ids]


class ByteTokenizer:
    """UTF-8 bytes: ``encode`` gives ids in ``[0, 256)``; ``decode`` uses ``errors='replace'``."""

    name = "byte"
    vocab_size = 256
    dtype = np.uint8

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


Tokenizer = ByteTokenizer | CharTokenizer


def tokenizer_from_json(d: dict[str, Any]) -> Tokenizer:
    """Rebuild a tokenizer from its ``to_json()`` dict (``name`` is ``"byte"`` or ``"char"``)."""
    name = d.get("name") if isinstance(d, dict) else None
    require(name in TOKENIZERS, "d['name']", f"one of {', '.join(map(repr, TOKENIZERS))}", name)
    return ByteTokenizer.from_json(d) if name == "byte" else CharTokenizer.from_json(d)
