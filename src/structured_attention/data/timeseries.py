"""Time series for forecasting (docs/design.md, 'Long-range time-series forecasting' and 'Data').

- :func:`read_csv_table` -> :class:`Table`: any UTF-8 CSV with a date column (named ``date``, else
  the first column, unless it holds numbers) and numeric columns; a missing value, a non-numeric cell or a ragged row is one
  ``ValueError`` line naming the column and the line;
- :func:`split_borders`: the standard borders -- ETTh1/ETTh2 (hourly, 30-day months): rows
  ``[0, 8640)`` train, ``[8640 - L, 11520)`` validation, ``[11520 - L, 14400)`` test; ETTm1/ETTm2
  (15 minutes) four times those; any other CSV 70% / 10% / 20% (the first ``int(0.7 n)`` rows
  train, the last ``int(0.2 n)`` test), each later split starting ``L`` rows early so its first
  window's lookback is the previous split's end;
- :class:`Scaler`: z-score with the mean and (population) standard deviation of the training rows
  only;
- :func:`load_series` -> :class:`SeriesData`: the above for one file, univariate (``features='S'``,
  the target column) or multivariate (``'M'``, every numeric column), with sliding windows of
  lookback ``L`` and horizon ``H`` (stride 1): window ``i`` of a split starting at row ``a`` is
  ``x = rows[a + i : a + i + L]``, ``y = rows[a + i + L : a + i + L + H]``;
- :func:`fetch_ett`: the public ETT CSVs from the ETDataset GitHub repository, only when asked
  (``download=True``), into a cache folder. Nothing here touches the network otherwise.
"""

from __future__ import annotations

import csv
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._checks import check_positive_int, require
from .._files import atomic_write
from .corpus import default_cache_dir

__all__ = [
    "ETT_DATASETS",
    "ETT_URL",
    "SPLITS",
    "Scaler",
    "SeriesData",
    "Table",
    "ett_cache_path",
    "fetch_ett",
    "load_series",
    "read_csv_table",
    "split_borders",
]

ETT_DATASETS = ("ETTh1", "ETTh2", "ETTm1", "ETTm2")
ETT_URL = "https://raw.githubusercontent.com/zhouhaoyi/ETDataset/main/ETT-small/{name}.csv"
SPLITS = ("train", "val", "test")
_MISSING = {"", "nan", "na", "n/a", "null", "none", "?"}


@dataclass(frozen=True)
class Table:
    """A parsed CSV: the date strings, the numeric column names and their values ``(rows, columns)``."""

    path: str
    dates: tuple[str, ...]
    columns: tuple[str, ...]
    values: np.ndarray  # float64


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def read_csv_table(path: str | Path) -> Table:
    """Read a CSV whose header names a date column (``date``, any case; else the first column,
    which must not hold numbers) and numeric columns. Raises ``FileNotFoundError`` for a missing file and a one-line
    ``ValueError`` for an empty file, a row with the wrong number of fields, a missing value
    (empty, ``NaN``, ``NA``, ``null``) or a non-numeric or non-finite cell."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"source: no such file: {str(p)!r}")
    try:
        with open(p, newline="", encoding="utf-8-sig") as f:
            rows = [r for r in csv.reader(f) if any(cell.strip() for cell in r)]
    except UnicodeDecodeError as e:
        raise ValueError(f"source: {str(p)!r} is not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x})") from None
    if len(rows) < 2:
        raise ValueError(f"source: {str(p)!r} has no data rows (expected a header line, then one row per time step)")
    header = [h.strip() for h in rows[0]]
    lowered = [h.lower() for h in header]
    date_col = lowered.index("date") if "date" in lowered else 0
    if date_col == 0 and lowered[0] != "date" and _is_number(rows[1][0]):
        # A first column of numbers is data, not dates: taking it as dates would drop it silently.
        raise ValueError(f"source: {str(p)!r} has no date column (expected a column named 'date', or dates in the "
                         f"first column; its first column {header[0]!r} holds numbers)")
    value_cols = [i for i in range(len(header)) if i != date_col]
    if not value_cols:
        raise ValueError(f"source: {str(p)!r} has only a date column; expected numeric columns beside it")
    values = np.empty((len(rows) - 1, len(value_cols)), dtype=np.float64)
    dates = []
    for r, row in enumerate(rows[1:]):
        line = r + 2  # 1-based, after the header
        if len(row) != len(header):
            raise ValueError(f"source: {str(p)!r} line {line} has {len(row)} fields, the header has {len(header)}")
        dates.append(row[date_col].strip())
        for c, i in enumerate(value_cols):
            cell = row[i].strip()
            if cell.lower() in _MISSING:
                raise ValueError(f"source: {str(p)!r} has a missing value in column {header[i]!r} at line {line}")
            try:
                x = float(cell)
            except ValueError:
                raise ValueError(
                    f"source: {str(p)!r} has a non-numeric value {cell!r} in column {header[i]!r} at line {line}"
                ) from None
            if not math.isfinite(x):
                raise ValueError(f"source: {str(p)!r} has a non-finite value {cell!r} in column {header[i]!r} at line {line}")
            values[r, c] = x
    return Table(str(p), tuple(dates), tuple(header[i] for i in value_cols), values)


def split_borders(dataset: str, n_rows: int, lookback: int) -> dict[str, tuple[int, int]]:
    """``{split: (first row, end row)}`` for ``train``, ``val`` and ``test`` (see the module doc).
    ``dataset`` is an ETT name (standard borders, which need 14400 rows hourly or 57600 at 15
    minutes) or ``'custom'`` (70/10/20)."""
    require(dataset in (*ETT_DATASETS, "custom"), "dataset", f"one of {', '.join((*ETT_DATASETS, 'custom'))}", dataset)
    if dataset.startswith("ETT"):
        month = 30 * 24 * (4 if dataset.startswith("ETTm") else 1)
        train, val, test = 12 * month, 4 * month, 4 * month
        need = train + val + test
        if n_rows < need:
            raise ValueError(f"source: {dataset} borders need {need} rows (12 + 4 + 4 thirty-day months), the file has "
                             f"{n_rows} (data.dataset=custom splits a file of one's own 70/10/20)")
    else:
        train, test = int(0.7 * n_rows), int(0.2 * n_rows)
        val = n_rows - train - test
    return {
        "train": (0, train),
        "val": (train - lookback, train + val),
        "test": (train + val - lookback, train + val + test),
    }


@dataclass(frozen=True)
class Scaler:
    """z-score per column: ``(x - mean) / std`` with the training rows' statistics (population
    standard deviation; a constant column gets ``std = 1``, as scikit-learn does)."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, values: np.ndarray) -> Scaler:
        std = values.std(axis=0)
        return cls(values.mean(axis=0), np.where(std > 0, std, 1.0))

    def transform(self, values: np.ndarray) -> np.ndarray:
        return (values - self.mean) / self.std

    def inverse(self, values: np.ndarray) -> np.ndarray:
        return values * self.std + self.mean

    def to_json(self) -> dict[str, list[float]]:
        return {"mean": [float(v) for v in self.mean], "std": [float(v) for v in self.std]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Scaler:
        return cls(np.asarray(d["mean"], dtype=np.float64), np.asarray(d["std"], dtype=np.float64))


@dataclass(frozen=True)
class SeriesData:
    """One series, scaled, with its split borders and sliding windows."""

    source: str
    dataset: str  # an ETT name or "custom"
    features: str  # "M" (all columns) or "S" (the target only)
    columns: tuple[str, ...]  # the model's channels, in order
    target: str
    lookback: int
    horizon: int
    dates: tuple[str, ...]
    raw: np.ndarray  # (rows, channels) float64, as read
    values: np.ndarray  # (rows, channels) float32, scaled with the training statistics
    borders: dict[str, tuple[int, int]]
    scaler: Scaler

    @property
    def n_channels(self) -> int:
        return len(self.columns)

    @property
    def target_index(self) -> int:
        return self.columns.index(self.target)

    def n_windows(self, split: str) -> int:
        a, b = self.borders[split]
        return max(b - a - self.lookback - self.horizon + 1, 0)

    def start(self, split: str, index: np.ndarray | int) -> np.ndarray | int:
        """First row of window(s) ``index`` of ``split``."""
        return self.borders[split][0] + index

    def windows(self, split: str, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` of windows ``index`` (a 1-D int array): ``(k, L, C)`` and ``(k, H, C)``, float32."""
        index = np.asarray(index, dtype=np.int64)
        n = self.n_windows(split)
        require(index.ndim == 1 and (index.size == 0 or (index.min() >= 0 and index.max() < n)), "index",
                f"a 1-D array of window indices in [0, {n})", index.shape)
        rows = self.start(split, index)[:, None] + np.arange(self.lookback + self.horizon)
        w = self.values[rows]
        return w[:, : self.lookback], w[:, self.lookback :]

    def describe(self) -> str:
        counts = ", ".join(f"{s} {self.n_windows(s):,}" for s in SPLITS)
        return (f"data: {self.source} ({self.dataset} borders) | {len(self.raw):,} rows, {self.n_channels} channel(s) "
                f"[{self.features}, target {self.target}] | lookback {self.lookback}, horizon {self.horizon} | windows: {counts}")


def ett_cache_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where :func:`fetch_ett` keeps ``name``: ``<cache_dir>/ett/<name>.csv`` (default cache:
    ``$SATTN_CACHE_DIR`` or ``~/.cache/structured-attention``)."""
    return Path(cache_dir).expanduser() / "ett" / f"{name}.csv" if cache_dir else default_cache_dir() / "ett" / f"{name}.csv"


def fetch_ett(name: str, cache_dir: str | Path | None = None, timeout: float = 60.0) -> Path:
    """Download the public ETT file ``name`` (ETDataset, CC BY-ND 4.0) into the cache, atomically,
    unless it is already there; return its path."""
    require(name in ETT_DATASETS, "dataset", f"one of {', '.join(ETT_DATASETS)} to download", name)
    path = ett_cache_path(name, cache_dir)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    url = ETT_URL.format(name=name)

    def download(tmp: str) -> None:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
            f.write(response.read())

    try:
        atomic_write(path, download)
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"download: could not fetch {url}: {getattr(e, 'reason', e)}") from None
    return path


def _resolve_source(source: str | Path | None, dataset: str | None, download: bool, cache_dir: str | Path | None) -> tuple[Path, str]:
    if source is not None:
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"source: no such file: {str(path)!r}")
        if dataset is None:  # a file named like an ETT dataset gets its standard borders
            dataset = path.stem if path.stem in ETT_DATASETS else "custom"
        return path, dataset
    require(dataset in ETT_DATASETS, "dataset",
            f"one of {', '.join(ETT_DATASETS)} when no source file is given", dataset)
    assert dataset is not None
    path = ett_cache_path(dataset, cache_dir)
    if path.is_file():
        return path, dataset
    if download:
        return fetch_ett(dataset, cache_dir), dataset
    raise FileNotFoundError(
        f"source: no file given and {dataset} is not in the cache ({str(path)!r}); pass source=PATH to a CSV "
        f"or download=true to fetch {ETT_URL.format(name=dataset)}"
    )


def load_series(
    source: str | Path | None = None,
    *,
    dataset: str | None = None,
    target: str = "OT",
    features: str = "M",
    lookback: int = 96,
    horizon: int = 96,
    download: bool = False,
    cache_dir: str | Path | None = None,
) -> SeriesData:
    """A forecasting series from ``source`` (a CSV path) or, when ``source`` is ``None``, the ETT
    file ``dataset`` from the cache (fetched first with ``download=True``).

    ``dataset=None`` takes the ETT borders when the file is named ``ETTh1.csv`` etc., else the
    70/10/20 split (``'custom'``). ``features='M'`` models every numeric column, ``'S'`` only
    ``target`` (which must be a column either way). Every split must hold at least one window of
    ``lookback + horizon`` rows. Errors are one line: ``FileNotFoundError`` for a missing file,
    ``ValueError`` otherwise."""
    check_positive_int(lookback, "lookback")
    check_positive_int(horizon, "horizon")
    require(features in ("M", "S"), "features", "'M' (multivariate) or 'S' (univariate: the target column)", features)
    path, dataset = _resolve_source(source, dataset, download, cache_dir)
    table = read_csv_table(path)
    require(target in table.columns, "target", f"one of the columns of {str(path)!r} ({', '.join(table.columns)})", target)
    columns = table.columns if features == "M" else (target,)
    raw = table.values[:, [table.columns.index(c) for c in columns]]
    borders = split_borders(dataset, len(raw), lookback)
    for split in SPLITS:
        a, b = borders[split]
        if a < 0 or b - a < lookback + horizon:
            raise ValueError(
                f"source: {str(path)!r} has {len(raw)} rows, too few for lookback {lookback} + horizon {horizon}: "
                f"the {split} split (rows {a}..{b}) holds no complete window of {lookback + horizon} rows"
            )
    train_a, train_b = borders["train"]
    scaler = Scaler.fit(raw[train_a:train_b])
    return SeriesData(
        source=str(path), dataset=dataset, features=features, columns=columns, target=target, lookback=lookback,
        horizon=horizon, dates=table.dates, raw=raw, values=scaler.transform(raw).astype(np.float32),
        borders=borders, scaler=scaler,
    )
