"""Batches of token windows for training and evaluation.

- :func:`sample_batch`: random windows, reproducible from ``(seed, step)`` alone, sharded over
  ranks so that the union of all ranks' batches at a step is one global batch.
- :func:`eval_batches`: consecutive non-overlapping windows from the start of a split.

Both return ``(x, y)`` ``LongTensor``\\ s of shape ``(batch, seq_len)`` with ``y`` the next tokens:
``x[b] = tokens[i : i + seq_len]``, ``y[b] = tokens[i + 1 : i + seq_len + 1]``. Given
``document_starts`` (a split's :attr:`Corpus.train_document_starts` or ``val_document_starts``)
they return ``(x, y, document_ids)``, where ``document_ids[b, t]`` is the index of the document
holding the input token ``x[b, t]`` (:func:`document_ids`), for ``GPT(x, y, document_ids=...)``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from .._checks import check_positive_int, require

__all__ = ["document_ids", "eval_batches", "sample_batch"]


def _check_tokens(tokens: object, seq_len: int) -> np.ndarray:
    require(
        isinstance(tokens, np.ndarray) and tokens.ndim == 1,
        "tokens",
        "a 1-D numpy array of token ids",
        getattr(tokens, "shape", type(tokens).__name__),
    )
    check_positive_int(seq_len, "seq_len")
    require(
        len(tokens) >= seq_len + 1,  # type: ignore[arg-type]
        "seq_len",
        f"at most len(tokens) - 1 = {len(tokens) - 1} (a window needs seq_len + 1 tokens)",  # type: ignore[arg-type]
        seq_len,
    )
    return tokens  # type: ignore[return-value]


def _to_xy(windows: np.ndarray, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64))
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    device = torch.device(device)
    if device.type != "cpu":
        x, y = x.to(device, non_blocking=False), y.to(device, non_blocking=False)
    return x, y


def _check_document_starts(starts: object, n_tokens: int) -> np.ndarray:
    require(
        isinstance(starts, np.ndarray) and starts.ndim == 1 and len(starts) > 0 and starts.dtype.kind in "iu",
        "document_starts",
        "a non-empty 1-D integer numpy array",
        getattr(starts, "shape", type(starts).__name__),
    )
    assert isinstance(starts, np.ndarray)
    require(
        starts[0] == 0 and bool(np.all(np.diff(starts) > 0)) and starts[-1] < n_tokens,
        "document_starts",
        f"increasing token indices starting at 0, all below len(tokens)={n_tokens}",
        starts[:8].tolist(),
    )
    return starts


def document_ids(document_starts: np.ndarray, window_starts: np.ndarray, seq_len: int) -> np.ndarray:
    """``(len(window_starts), seq_len)`` int64: the index of the document holding each token
    ``window_starts[b] + t``, ``t < seq_len``, given the token index where each document starts."""
    positions = np.asarray(window_starts, dtype=np.int64)[:, None] + np.arange(seq_len)
    return np.searchsorted(document_starts, positions, side="right") - 1


def _batch(
    tokens: np.ndarray, window_starts: np.ndarray, seq_len: int, document_starts: np.ndarray | None,
    device: torch.device | str,
) -> tuple[torch.Tensor, ...]:
    x, y = _to_xy(tokens[window_starts[:, None] + np.arange(seq_len + 1)], device)
    if document_starts is None:
        return x, y
    ids = torch.from_numpy(document_ids(document_starts, window_starts, seq_len))
    return x, y, ids.to(x.device)


def _check_nonneg_int(value: object, name: str) -> int:
    require(
        isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0,
        name,
        "a non-negative integer",
        value,
    )
    return int(value)  # type: ignore[arg-type]


def sample_batch(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    *,
    seed: int,
    step: int,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
    document_starts: np.ndarray | None = None,
) -> tuple[torch.Tensor, ...]:
    """This rank's ``(x, y)`` windows for training step ``step``, each ``(batch_size, seq_len)``,
    and with ``document_starts`` their ``document_ids`` as a third tensor (the windows are the same).

    The global batch is ``batch_size * world_size`` window starts drawn uniformly from
    ``[0, len(tokens) - seq_len - 1]`` by ``np.random.default_rng([seed, step]).integers``; rank
    ``r`` gets rows ``[r * batch_size, (r + 1) * batch_size)``. It depends on ``(seed, step)`` only
    (no hidden state), so a resumed run draws the same batches, and one process with
    ``batch_size * world_size`` sees exactly the concatenation, in rank order, of the ranks' batches.
    """
    tokens = _check_tokens(tokens, seq_len)
    check_positive_int(batch_size, "batch_size")
    check_positive_int(world_size, "world_size")
    seed = _check_nonneg_int(seed, "seed")
    step = _check_nonneg_int(step, "step")
    rank = _check_nonneg_int(rank, "rank")
    require(rank < world_size, "rank", f"an integer in [0, world_size={world_size})", rank)
    if document_starts is not None:
        document_starts = _check_document_starts(document_starts, len(tokens))
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size * world_size)
    mine = starts[rank * batch_size : (rank + 1) * batch_size]
    return _batch(tokens, mine, seq_len, document_starts, device)


def eval_batches(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    device: torch.device | str = "cpu",
    document_starts: np.ndarray | None = None,
) -> Iterator[tuple[torch.Tensor, ...]]:
    """``(x, y)`` (with ``document_starts``: ``(x, y, document_ids)``) over consecutive
    non-overlapping windows from the start of ``tokens``.

    Window ``j`` starts at ``j * seq_len`` (so the targets of consecutive windows tile
    ``tokens[1 : n * seq_len + 1]`` exactly); there are ``n = (len(tokens) - 1) // seq_len``
    windows, grouped in order into batches of ``batch_size`` (the last one may be smaller), and at
    most ``max_batches`` batches are yielded. Arguments are checked when this is called.
    """
    tokens = _check_tokens(tokens, seq_len)
    check_positive_int(batch_size, "batch_size")
    if max_batches is not None:
        check_positive_int(max_batches, "max_batches")
    if document_starts is not None:
        document_starts = _check_document_starts(document_starts, len(tokens))
    n_windows = (len(tokens) - 1) // seq_len
    n_batches = -(-n_windows // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)

    def generate() -> Iterator[tuple[torch.Tensor, ...]]:
        for b in range(n_batches):
            starts = np.arange(b * batch_size, min((b + 1) * batch_size, n_windows)) * seq_len
            yield _batch(tokens, starts, seq_len, document_starts, device)

    return generate()
