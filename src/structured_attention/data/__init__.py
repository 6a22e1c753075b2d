"""The language-modelling data layer (docs/design.md, 'Language modelling' and 'Data').

- :func:`load_corpus` -> :class:`Corpus`: a text source (the embedded stdlib corpus, a file or
  folder, a Hugging Face dataset) split into train/validation by document, tokenised once into
  cached memory-mapped shards;
- :class:`ByteTokenizer`, :class:`CharTokenizer`, :func:`tokenizer_from_json`;
- :func:`sample_batch` (random windows reproducible from ``(seed, step)``, sharded by rank) and
  :func:`eval_batches` (consecutive windows), with the windows' :func:`document_ids` when given a
  split's document starts (packed documents).
"""

from .batches import document_ids, eval_batches, sample_batch
from .corpus import DOC_SEPARATOR, Corpus, default_cache_dir, load_corpus, split_documents, stdlib_files
from .tokenizers import TOKENIZERS, ByteTokenizer, CharTokenizer, Tokenizer, tokenizer_from_json

__all__ = [
    "ByteTokenizer",
    "CharTokenizer",
    "Corpus",
    "DOC_SEPARATOR",
    "TOKENIZERS",
    "Tokenizer",
    "default_cache_dir",
    "document_ids",
    "eval_batches",
    "load_corpus",
    "sample_batch",
    "split_documents",
    "stdlib_files",
    "tokenizer_from_json",
]
