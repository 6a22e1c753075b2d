"""Long-range time-series forecasting: ETT or any CSV, the point-token and the patch forecasters,
test MSE and MAE on normalised data (docs/design.md, 'Long-range time-series forecasting').

- :class:`TSConfig` (``model: ForecasterConfig``, ``data: TSDataConfig``, ``optim: OptimConfig``,
  ``run: TSRunConfig``), read with :func:`load_ts_config` (YAML + ``section.key=value``);
- :class:`ForecastTask`, the series and the forecaster as the shared loop
  (:func:`training.fit`) sees them: training batches are whole epochs of shuffled training
  windows, validation is MSE (the ``val_loss`` that early stopping watches) and MAE;
- :func:`forecast_metrics` (MSE and MAE over every window of a split, the last partial batch
  included) and :func:`predict`;
- :func:`train_ts` -> :class:`ForecastResult`: train, reload the best-validation model from
  ``<out_dir>/best/``, score it on the test split (:class:`ForecastScores`), write
  ``<out_dir>/test.json``; :func:`load_forecaster` rebuilds a trained model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn

from ..._checks import fail, require
from ...data.timeseries import Scaler, SeriesData, load_series
from ...models.forecasting import ForecasterConfig, build_forecaster
from ...models.protocol import TrainableModel
from ...models.transformer import TransformerConfig
from ...training.checkpoint import LoadedCheckpoint, load_checkpoint
from ...training.config import OptimConfig, RunConfig, load_config
from ...training.distributed import DistInfo
from ...training.loop import FitResult, Task, fit
from .. import load_trained

__all__ = [
    "ForecastResult",
    "ForecastScores",
    "ForecastTask",
    "TSConfig",
    "TSDataConfig",
    "TSRunConfig",
    "checkpoint_series",
    "forecast_metrics",
    "load_forecaster",
    "load_ts_config",
    "predict",
    "train_ts",
]

# PatchTST's and DLinear's test loader (batch 128 in PatchTST's ETT scripts) drops the last partial
# batch, so their published figures average over the first n // 128 * 128 test windows only
PUBLISHED_TEST_BATCH = 128


# a forecaster's defaults: its lookback, horizon and channels are the data's unless set otherwise
_MODEL_DEFAULTS = ForecasterConfig()


@dataclass(frozen=True)
class TSDataConfig:
    source: str | None = None  # a CSV path; None: the ETT file `dataset` from the cache
    dataset: str | None = None  # ETTh1/ETTh2/ETTm1/ETTm2 (standard borders) or custom (70/10/20); None: from the file name
    target: str = "OT"
    features: str = "M"  # "M": every numeric column; "S": the target only
    lookback: int = 96
    horizon: int = 96
    download: bool = False  # fetch a missing ETT file from the ETDataset GitHub repository
    cache_dir: str | None = None  # None: $SATTN_CACHE_DIR or ~/.cache/structured-attention

    def __post_init__(self) -> None:
        require(self.features in ("M", "S"), "data.features", "'M' (multivariate) or 'S' (univariate)", self.features)
        for name in ("lookback", "horizon"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"data.{name}", "a positive integer", value)


@dataclass(frozen=True)
class TSRunConfig(RunConfig):
    out_dir: str = "runs/ts"
    keep_best: bool = True  # the test split is scored with the best-validation model
    patience: int = 5
    examples: int = 3  # test windows whose forecasts test.json keeps (for plots)
    # model.linear_skip starts at the ridge-regression fit (squared error + skip_ridge * |W|^2) on
    # the training windows; see fit_linear_skip
    skip_ridge: float = 100.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.skip_ridge >= 0, "run.skip_ridge", "a non-negative number", self.skip_ridge)
        require(isinstance(self.examples, int) and self.examples >= 0, "run.examples", "a non-negative integer", self.examples)


@dataclass(frozen=True)
class TSConfig:
    model: ForecasterConfig = field(default_factory=ForecasterConfig)
    data: TSDataConfig = field(default_factory=TSDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: TSRunConfig = field(default_factory=TSRunConfig)

    def __post_init__(self) -> None:
        # The data decides a forecaster's lookback and horizon (and its channels, the file's): a
        # model.* value of its own would otherwise be silently replaced by the data section's.
        for name in ("lookback", "horizon"):
            value, data = getattr(self.model, name), getattr(self.data, name)
            if value not in (getattr(_MODEL_DEFAULTS, name), data):
                fail(f"model.{name}", f"data.{name}'s value, {data} (the data section sets a forecaster's {name}: "
                                      f"set data.{name})", value)
        # An unknown kind, bad ranks or MLR block sizes that do not divide the token count
        # (the context) fail here with the layer's one-line message.
        self.model_for_data().backbone_config().check_attention()

    def model_for_data(self, n_channels: int | None = None) -> ForecasterConfig:
        """``model`` with what the data decides: the data section's lookback and horizon, and the
        file's ``n_channels`` once it is read (what :meth:`ForecastTask.resolve` fills in)."""
        channels = self.model.n_channels if n_channels is None else n_channels
        return dataclasses.replace(self.model, lookback=self.data.lookback, horizon=self.data.horizon,
                                   n_channels=channels)


def load_ts_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TSConfig:
    """A :class:`TSConfig` from a YAML file (``None``: defaults) and ``section.key=value`` overrides."""
    return load_config(TSConfig, path, overrides)


def _load_data(d: TSDataConfig, source: str | Path | None = None) -> SeriesData:
    """The series ``d`` names (or ``source`` in place of ``d.source``), scaled with its training rows."""
    return load_series(d.source if source is None else source, dataset=d.dataset, target=d.target,
                       features=d.features, lookback=d.lookback, horizon=d.horizon, download=d.download,
                       cache_dir=d.cache_dir)


def _batches(n: int, batch_size: int) -> list[np.ndarray]:
    return [np.arange(a, min(a + batch_size, n)) for a in range(0, n, batch_size)]


@torch.no_grad()
def predict(model: nn.Module, data: SeriesData, split: str, index: np.ndarray, batch_size: int = 256,
            device: torch.device | str = "cpu") -> np.ndarray:
    """Forecasts ``(k, H, C)`` (normalised units) of windows ``index`` of ``split``."""
    was_training = model.training
    model.eval()
    out = []
    for chunk in _batches(len(index), batch_size):
        x, _ = data.windows(split, index[chunk])
        out.append(model(torch.from_numpy(x).to(device)).float().cpu().numpy())
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, data.horizon, data.n_channels), np.float32)


@torch.no_grad()
def forecast_metrics(model: nn.Module, data: SeriesData, split: str, batch_size: int = 256,
                     device: torch.device | str = "cpu", index: np.ndarray | None = None) -> dict[str, float]:
    """``{"mse", "mae"}`` on normalised data, averaged over every value of every window of
    ``split`` (or of windows ``index``), the last partial batch included."""
    index = np.arange(data.n_windows(split)) if index is None else np.asarray(index)
    sq = ab = 0.0
    count = 0
    was_training = model.training
    model.eval()
    for chunk in _batches(len(index), batch_size):
        x, y = data.windows(split, index[chunk])
        err = model(torch.from_numpy(x).to(device)).double() - torch.from_numpy(y).to(device).double()
        sq += float(err.square().sum())
        ab += float(err.abs().sum())
        count += err.numel()
    model.train(was_training)
    return {"mse": sq / count, "mae": ab / count}


def _spread(n: int, k: int) -> np.ndarray:
    """``min(n, k)`` window indices spread evenly over ``[0, n)``, first and last included."""
    return np.unique(np.linspace(0, n - 1, min(n, k)).round().astype(np.int64))


class ForecastTask(Task):
    """Direct multi-step forecasting: MSE between forecast and truth (normalised) on shuffled
    training windows, a fresh permutation of all of them every epoch."""

    experiment = "ts"

    config: TSConfig

    def __init__(self, config: TSConfig) -> None:
        super().__init__(config)
        self.data: SeriesData | None = None

    def setup(self, info: DistInfo) -> None:
        self.data = _load_data(self.config.data)

    def resolve(self) -> TSConfig:
        """The model's lookback and horizon are the data section's, its channels the file's."""
        assert self.data is not None
        channels = self.requested.model.n_channels
        if channels not in (_MODEL_DEFAULTS.n_channels, self.data.n_channels):
            fail("model.n_channels", f"the file's channel count, {self.data.n_channels} (data.features and the "
                                     f"file set it)", channels)
        return dataclasses.replace(self.requested, model=self.requested.model_for_data(self.data.n_channels))

    def describe(self) -> str:
        assert self.data is not None
        m, run = self.config.model, self.config.run
        per_epoch = max(self.data.n_windows("train") // run.batch_size, 1)
        return (f"{self.data.describe()} | {m.family} model, {m.n_tokens} tokens per sequence, attention {m.backbone.attention} "
                f"| {per_epoch} steps per epoch")

    def build_model(self) -> nn.Module:
        assert self.data is not None
        model = build_forecaster(self.config.model)
        if getattr(model, "skip", None) is not None:
            fit_linear_skip(model, self.data, self.config.run.skip_ridge)
        return model

    def train_windows(self, index: int, rank: int, world_size: int) -> np.ndarray:
        """The training-window indices of this rank's share of global batch ``index``: epoch
        ``e = index // (n // global batch)`` is a permutation of all ``n`` windows drawn from
        ``(run.seed, e)``, cut into consecutive global batches (the remainder is left out)."""
        assert self.data is not None
        run = self.config.run
        n, size = self.data.n_windows("train"), run.batch_size * world_size
        per_epoch = n // size
        if per_epoch == 0:  # fewer windows than one global batch: draw with replacement
            chosen = np.random.default_rng([run.seed, index]).integers(0, n, size)
        else:
            epoch, pos = divmod(index, per_epoch)
            chosen = np.random.default_rng([run.seed, epoch]).permutation(n)[pos * size:(pos + 1) * size]
        return chosen[rank * run.batch_size:(rank + 1) * run.batch_size]

    def batch(self, index: int, rank: int, world_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.data is not None
        x, y = self.data.windows("train", self.train_windows(index, rank, world_size))
        return torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x).float(), y)

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        # At most eval_batches global batches of validation windows, evenly spread (neighbouring
        # windows overlap in all but one row, so a spread subset loses little and saves time).
        assert self.data is not None
        run = self.config.run
        index = _spread(self.data.n_windows("val"), run.eval_batches * run.batch_size * self.world_size)
        m = forecast_metrics(model, self.data, "val", run.batch_size, device, index)
        return {"val_loss": m["mse"], "val_mae": m["mae"]}

    def backbone_config(self) -> TransformerConfig:
        return self.config.model.backbone_config()

    def tokens_per_batch(self) -> int:
        return self.config.run.batch_size * self.config.model.tokens_per_example

    def flops_per_token(self, model: TrainableModel) -> float:
        return model.training_flops_per_token()

    def state(self) -> dict[str, Any]:
        assert self.data is not None
        return {"scaler": self.data.scaler.to_json(), "columns": list(self.data.columns), "source": self.data.source,
                "dataset": self.data.dataset}


@torch.no_grad()
def fit_linear_skip(model: nn.Module, data: SeriesData, ridge: float, chunk: int = 1024) -> None:
    """Set ``model.skip`` (``Linear(L -> H)``, shared by the channels) to the ridge-regression fit of
    every training window's horizon from its lookback, channel by channel, with a zero bias.

    The skip acts on RevIN's normalised series ``z = (x - m) / s`` (lookback mean ``m``, standard
    deviation ``s``; RevIN starts as the identity) and its output is scaled back, so with a zero
    bias its error in the data's units is ``(y - m) - W (x - m)``. The fit minimises that (the
    metric's units, not the normalised ones, which would weight quiet windows by ``1 / s^2``) plus
    ``ridge * |W|^2``. (A bias would add ``b s``, an offset that follows the lookback's spread and
    does not carry over to later periods.) Without RevIN it regresses ``y`` on ``x``."""
    L, H = data.lookback, data.horizon
    xx = torch.zeros(L, L, dtype=torch.float64)
    xy = torch.zeros(L, H, dtype=torch.float64)
    n = data.n_windows("train")
    for a in range(0, n, chunk):
        x, y = data.windows("train", np.arange(a, min(a + chunk, n)))
        x = torch.from_numpy(x).double().transpose(1, 2).flatten(0, 1)  # (windows * C, L)
        y = torch.from_numpy(y).double().transpose(1, 2).flatten(0, 1)  # (windows * C, H)
        if model.revin is not None:
            mean = x.mean(1, keepdim=True)
            x, y = x - mean, y - mean
        xx += x.T @ x
        xy += x.T @ y
    w = torch.linalg.solve(xx + ridge * torch.eye(L, dtype=torch.float64), xy)  # (L, H)
    model.skip.weight.copy_(w.T.float())
    model.skip.bias.zero_()


@dataclass(frozen=True, kw_only=True)
class ForecastScores:
    """The trained forecaster's scores (normalised units): MSE and MAE over every test window, the
    best evaluation's on the validation windows, ``examples`` (test windows of the target channel:
    the lookback, the truth and the forecast), and where they apply the scores over the test
    windows PatchTST's published figures used (:data:`PUBLISHED_TEST_BATCH`; ``None`` when the
    split has fewer) and the ridge-fitted linear skip's alone (``model.linear_skip``)."""

    test_mse: float
    test_mae: float
    val_mse: float
    val_mae: float
    test_windows: int
    params: int
    examples: list[dict[str, Any]]
    published_windows: int | None = None
    test_mse_published_windows: float | None = None
    test_mae_published_windows: float | None = None
    skip_test_mse: float | None = None
    skip_test_mae: float | None = None


@dataclass(kw_only=True)
class ForecastResult(FitResult):
    """What :func:`train_ts` returns: the loop's :class:`~structured_attention.training.FitResult`
    and, on rank 0, the best-validation model's :class:`ForecastScores` (``None`` on other ranks)."""

    scores: ForecastScores | None = None

    def test_json(self) -> dict[str, Any]:
        """``<out_dir>/test.json``: the scores that apply, with the run's steps, best step, early stop
        and time."""
        if self.scores is None:
            return {}
        scores = {k: v for k, v in dataclasses.asdict(self.scores).items() if v is not None}
        return {**scores, "best_step": self.best_step, "steps": self.steps, "stopped_early": self.stopped_early,
                "wall_s": self.wall_s}


def train_ts(config: TSConfig, *, resume: bool = False, stream: TextIO | None = None) -> ForecastResult:
    """Train a forecaster as ``config`` says (see :func:`training.fit`), then score the
    best-validation model (``<out_dir>/best/``; the last one without ``run.keep_best``) on every
    test window and write :meth:`ForecastResult.test_json` to ``<out_dir>/test.json``."""
    task = ForecastTask(config)
    result = fit(task, resume=resume, stream=stream)
    if result.model is None:  # a non-zero rank under torchrun: rank 0 reports
        return ForecastResult.extend(result)
    model = result.model
    best_dir = Path(result.out_dir) / "best"
    val = result.final  # the validation scores of the model scored on the test windows
    if config.run.keep_best and best_dir.is_dir():
        model.load_state_dict(load_checkpoint(best_dir).model_state)
        val = result.best
    data = task.data
    assert data is not None
    device = next(model.parameters()).device
    test = forecast_metrics(model, data, "test", config.run.batch_size, device)
    index = _spread(data.n_windows("test"), config.run.examples) if config.run.examples else np.zeros(0, np.int64)
    forecast = predict(model, data, "test", index, config.run.batch_size, device)
    x, y = data.windows("test", index)
    t = data.target_index
    extra: dict[str, Any] = {}
    n_published = data.n_windows("test") // PUBLISHED_TEST_BATCH * PUBLISHED_TEST_BATCH
    if n_published:
        published = forecast_metrics(model, data, "test", config.run.batch_size, device, index=np.arange(n_published))
        extra.update(test_mse_published_windows=published["mse"], test_mae_published_windows=published["mae"],
                     published_windows=n_published)
    if getattr(model, "skip", None) is not None:  # a fresh model is the ridge-fitted linear skip alone
        skip = forecast_metrics(task.build_model().to(device), data, "test", config.run.batch_size, device)
        extra.update(skip_test_mse=skip["mse"], skip_test_mae=skip["mae"])
    scores = ForecastScores(
        test_mse=test["mse"], test_mae=test["mae"], val_mse=val["val_loss"], val_mae=val["val_mae"],
        test_windows=data.n_windows("test"), params=sum(p.numel() for p in model.parameters()),
        examples=[
            {"window": int(i), "start_date": data.dates[int(data.start("test", int(i))) + data.lookback],
             "channel": data.target, "history": x[k, :, t].tolist(), "truth": y[k, :, t].tolist(),
             "forecast": forecast[k, :, t].tolist()}
            for k, i in enumerate(index)
        ],
        **extra,
    )
    out = ForecastResult.extend(result, scores=scores)
    (Path(result.out_dir) / "test.json").write_text(json.dumps(out.test_json(), indent=1) + "\n", encoding="utf-8")
    return out


def load_forecaster(path: str | Path | LoadedCheckpoint, device: str | torch.device = "cpu"
                    ) -> tuple[nn.Module, TSConfig, LoadedCheckpoint]:
    """``(model in eval mode, config, checkpoint)`` from a forecasting checkpoint
    (:func:`~structured_attention.experiments.load_trained`; ``<out_dir>/best``, ``<out_dir>/ckpt``...).
    The scaler's statistics are in ``checkpoint.state['scaler']``, the channels in
    ``checkpoint.state['columns']``."""
    return load_trained(path, "ts", TSConfig, lambda c: build_forecaster(c.model), device)



def checkpoint_series(config: TSConfig, ckpt: LoadedCheckpoint, source: str | Path | None = None) -> SeriesData:
    """The series a forecasting checkpoint was trained on (``config.data``), or ``source``, a CSV
    with the same columns, scaled with the training statistics saved in the checkpoint, so its
    metrics are in the units the model was trained and validated in. ``ValueError`` (one line,
    naming ``--source`` or ``data.source``) when the file's channels are not the model's."""
    data = _load_data(config.data, source)
    columns = tuple(ckpt.state.get("columns") or ())
    if data.columns != columns:
        name = "--source" if source is not None else "data.source"
        raise ValueError(f"{name}: {data.source!r} has the channels {', '.join(data.columns)}; the checkpoint's "
                         f"model reads {', '.join(columns) or '(none recorded)'}")
    scaler = Scaler.from_json(ckpt.state["scaler"])
    return dataclasses.replace(data, scaler=scaler, values=scaler.transform(data.raw).astype(np.float32))
