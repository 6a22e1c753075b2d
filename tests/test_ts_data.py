"""Time-series data: CSV parsing, the standard ETT borders, train-only scaling, sliding windows,
univariate/multivariate modes and one-line errors. Every file is synthetic (no ../shared, no network)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from structured_attention.data import timeseries
from structured_attention.data.timeseries import Scaler, load_series, read_csv_table, split_borders

COLUMNS = ["HUFL", "HULL", "OT"]


def write_csv(path: Path, values: np.ndarray, columns=COLUMNS, date_name: str = "date") -> Path:
    dates = np.datetime64("2016-07-01T00:00") + np.arange(len(values)) * np.timedelta64(1, "h")
    lines = [",".join([date_name, *columns])]
    lines += [",".join([str(d).replace("T", " "), *(repr(float(v)) for v in row)]) for d, row in zip(dates, values)]
    path.write_text("\n".join(lines) + "\n")
    return path


def series(n: int, c: int = 3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.normal(size=(n, c)), axis=0) + 10 * np.arange(c)


def test_read_csv_table_keeps_dates_columns_and_values(tmp_path):
    values = series(30)
    table = read_csv_table(write_csv(tmp_path / "x.csv", values))
    assert table.columns == tuple(COLUMNS) and len(table.dates) == 30
    assert table.dates[1] == "2016-07-01 01:00"
    np.testing.assert_array_equal(table.values, values)


def test_date_column_is_found_by_name_anywhere(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,Date,b\n1,2020-01-01,2\n3,2020-01-02,4\n")
    table = read_csv_table(path)
    assert table.columns == ("a", "b") and table.dates == ("2020-01-01", "2020-01-02")
    np.testing.assert_array_equal(table.values, [[1, 2], [3, 4]])


@pytest.mark.parametrize("dataset,month", [("ETTh1", 720), ("ETTh2", 720), ("ETTm1", 2880), ("ETTm2", 2880)])
def test_ett_borders_follow_the_protocol(dataset, month):
    lookback = 336
    b = split_borders(dataset, 20 * month + 5, lookback)
    assert b == {"train": (0, 12 * month), "val": (12 * month - lookback, 16 * month),
                 "test": (16 * month - lookback, 20 * month)}
    if dataset == "ETTh1":  # the protocol's ETTh1 rows (docs/design.md, 'Long-range time-series forecasting')
        assert b["train"][1] == 8640 and b["val"] == (8640 - lookback, 11520) and b["test"] == (11520 - lookback, 14400)


def test_custom_borders_are_70_10_20():
    b = split_borders("custom", 1000, 24)
    assert b == {"train": (0, 700), "val": (676, 800), "test": (776, 1000)}


def test_ett_file_gets_ett_borders_window_counts_and_train_only_scaling(tmp_path):
    n, lookback, horizon = 14400 + 17, 96, 48
    values = series(n)
    values[8640:] += 1000.0  # the future must not leak into the scaling statistics
    data = load_series(write_csv(tmp_path / "ETTh1.csv", values), lookback=lookback, horizon=horizon)
    assert data.dataset == "ETTh1" and data.columns == tuple(COLUMNS) and data.n_channels == 3
    # windows per split: rows in the split - L - H + 1
    assert data.n_windows("train") == 8640 - lookback - horizon + 1
    assert data.n_windows("val") == (11520 - (8640 - lookback)) - lookback - horizon + 1 == 2880 - horizon + 1
    assert data.n_windows("test") == 2880 - horizon + 1
    train = values[:8640]
    np.testing.assert_allclose(data.scaler.mean, train.mean(axis=0))
    np.testing.assert_allclose(data.scaler.std, train.std(axis=0))  # population std, as StandardScaler
    np.testing.assert_allclose(data.values, ((values - train.mean(0)) / train.std(0)).astype(np.float32), rtol=1e-6)


def test_windows_are_the_raw_slices(tmp_path):
    n, lookback, horizon = 300, 24, 12
    values = series(n)
    data = load_series(write_csv(tmp_path / "mine.csv", values), lookback=lookback, horizon=horizon)
    assert data.dataset == "custom"
    for split in ("train", "val", "test"):
        a, _ = data.borders[split]
        idx = np.array([0, 3, data.n_windows(split) - 1])
        x, y = data.windows(split, idx)
        assert x.shape == (3, lookback, 3) and y.shape == (3, horizon, 3) and x.dtype == np.float32
        for k, i in enumerate(idx):
            raw_x = values[a + i:a + i + lookback]
            raw_y = values[a + i + lookback:a + i + lookback + horizon]
            np.testing.assert_allclose(data.scaler.inverse(x[k]), raw_x, rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(data.scaler.inverse(y[k]), raw_y, rtol=1e-5, atol=1e-4)
    # the last test window ends on the last row of the test split
    a, b = data.borders["test"]
    assert a + data.n_windows("test") - 1 + lookback + horizon == b == n
    with pytest.raises(ValueError, match="index"):
        data.windows("test", np.array([data.n_windows("test")]))


def test_univariate_mode_keeps_the_target_column_only(tmp_path):
    values = series(200)
    data = load_series(write_csv(tmp_path / "u.csv", values), features="S", target="HULL", lookback=16, horizon=8)
    assert data.columns == ("HULL",) and data.n_channels == 1
    x, _ = data.windows("train", np.array([5]))
    train = values[:140, 1]
    np.testing.assert_allclose(x[0, :, 0], (values[5:21, 1] - train.mean()) / train.std(), rtol=1e-5)


def test_scaler_constant_column_and_json_round_trip():
    values = np.array([[1.0, 5.0], [3.0, 5.0]])
    s = Scaler.fit(values)
    np.testing.assert_array_equal(s.std, [1.0, 1.0])
    s2 = Scaler.from_json(s.to_json())
    np.testing.assert_array_equal(s2.inverse(s2.transform(values)), values)


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("cell,what", [("", "missing value"), ("NaN", "missing value"), ("abc", "non-numeric value 'abc'"),
                                       ("inf", "non-finite value")])
def test_bad_cells_name_column_and_line(tmp_path, cell, what):
    path = write_csv(tmp_path / "bad.csv", series(50))
    lines = path.read_text().splitlines()
    fields = lines[7].split(",")
    fields[2] = cell  # column HULL, line 8 of the file
    lines[7] = ",".join(fields)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        load_series(path, lookback=4, horizon=2)
    assert what in one_line(err) and "'HULL'" in one_line(err) and "line 8" in one_line(err)


def test_ragged_row_and_unknown_target_and_too_few_rows(tmp_path):
    path = write_csv(tmp_path / "r.csv", series(50))
    path.write_text(path.read_text() + "2020-01-01,1,2\n")
    with pytest.raises(ValueError, match="line 52 has 3 fields, the header has 4"):
        load_series(path, lookback=4, horizon=2)
    path = write_csv(tmp_path / "t.csv", series(50))
    with pytest.raises(ValueError) as err:
        load_series(path, target="nope", lookback=4, horizon=2)
    assert one_line(err).startswith("target: expected one of the columns") and "HUFL, HULL, OT" in one_line(err)
    with pytest.raises(ValueError) as err:
        load_series(path, lookback=4, horizon=6)  # the val split has 5 rows of its own, fewer than the horizon
    assert "too few for lookback 4 + horizon 6" in one_line(err) and "val split" in one_line(err)
    with pytest.raises(ValueError, match="ETTh1 borders need 14400 rows"):
        load_series(write_csv(tmp_path / "ETTh1.csv", series(1000)), lookback=8, horizon=4)


def test_a_csv_without_a_date_column_or_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "nodate.csv"
    path.write_text("HUFL,HULL,OT\n" + "".join(f"{i},{i + 1},{i + 2}\n" for i in range(50)))
    with pytest.raises(ValueError) as err:
        load_series(path, lookback=4, horizon=2)
    assert one_line(err) == (f"source: {str(path)!r} has no date column (expected a column named 'date', or dates "
                             f"in the first column; its first column 'HUFL' holds numbers)")
    latin = tmp_path / "latin1.csv"
    latin.write_bytes("date,t\u00e9mp\n2020-01-01,1\n".encode("latin-1"))
    with pytest.raises(ValueError) as err:
        load_series(latin, lookback=4, horizon=2)
    assert one_line(err) == f"source: {str(latin)!r} is not UTF-8 text (byte 6 is 0xe9)"


def test_missing_file_and_uncached_ett_never_download_by_default(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the loader must not touch the network unless asked")

    monkeypatch.setattr(timeseries.urllib.request, "urlopen", no_network)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_series(tmp_path / "absent.csv")
    with pytest.raises(FileNotFoundError) as err:
        load_series(None, dataset="ETTh2", cache_dir=tmp_path)
    assert "download=true" in one_line(err) and "ETTh2.csv" in one_line(err)


def test_download_only_when_asked_into_the_cache(tmp_path, monkeypatch):
    body = write_csv(tmp_path / "payload.csv", series(14400, c=2), columns=["HUFL", "OT"])
    calls = []

    class Response:
        def __init__(self, url):
            calls.append(url)

        def read(self):
            return body.read_bytes()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(timeseries.urllib.request, "urlopen", lambda url, timeout: Response(url))
    data = load_series(None, dataset="ETTh2", download=True, cache_dir=tmp_path / "cache", lookback=96, horizon=96)
    assert calls == [timeseries.ETT_URL.format(name="ETTh2")]
    assert Path(data.source) == tmp_path / "cache" / "ett" / "ETTh2.csv" and data.dataset == "ETTh2"
    load_series(None, dataset="ETTh2", download=True, cache_dir=tmp_path / "cache")  # cached: no second fetch
    assert len(calls) == 1
    assert not [p for p in (tmp_path / "cache" / "ett").iterdir() if p.name.startswith(".tmp")]
