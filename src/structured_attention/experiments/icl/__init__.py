"""In-context linear regression (Garg et al. 2022; docs/design.md, 'In-context linear regression'):
a causal transformer reads prompts ``x_1, y_1, ..., x_N`` of a random linear function and predicts
every ``y_i`` from the examples before it.

- :class:`ICLConfig` (``model: TransformerConfig``, ``task: RegressionConfig``, ``optim``,
  ``run``), read with :func:`load_icl_config` (YAML + ``section.key=value`` overrides);
- :class:`ICLTask`, prompts and the :class:`~structured_attention.models.regression.RegressionTransformer`
  as the shared loop (:func:`training.fit`) sees them; the training loss is the squared error of
  the ``y`` predictions divided by the active dimensions;
- :func:`error_curves`: MSE normalised by ``d`` against the number of in-context examples, for the
  model and the baselines of :mod:`.baselines` on the same prompts;
- :func:`train_icl` -> :class:`ICLResult` (the loop's result, error curves, curriculum-exact
  training FLOPs);
- :func:`load_icl`: a trained model and its config back from a checkpoint.

Training FLOPs follow the curriculum: a step at ``T`` tokens per prompt costs
``batch x T x 6 x RegressionTransformer.forward_flops_per_position(T)`` (:func:`training_flops`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from torch import nn

from ..._checks import require
from ...data.regression import Curriculum, Prompts, sample_prompts
from ...models.regression import RegressionTransformer
from ...models.protocol import TrainableModel
from ...models.transformer import TransformerConfig
from ...training.checkpoint import LoadedCheckpoint
from ...training.config import OptimConfig, RunConfig, load_config
from ...training.distributed import DistInfo
from ...training.loop import FitResult, Task, autocast_context, fit
from .. import load_trained
from .baselines import baseline_predictions

__all__ = [
    "ICLConfig",
    "ICLResult",
    "ICLRunConfig",
    "ICLTask",
    "RegressionConfig",
    "build_icl_model",
    "error_curves",
    "load_icl",
    "load_icl_config",
    "train_icl",
    "training_flops",
]


@dataclass(frozen=True)
class RegressionConfig:
    """The regression task and its curriculum (``task`` section)."""

    n_dims: int = 16  # d
    n_points: int | None = None  # N per prompt; None: 2d + 1, so the last prediction sees 2d examples
    noise_std: float = 0.0  # noisy variant: y = w^T x + N(0, noise_std^2)
    sparsity: int | None = None  # sparse variant: w has this many non-zero coordinates
    # curriculum (Garg et al.): active dims and points start here and grow every `curriculum_every`
    # steps by `dims_inc` / `points_inc`; None or curriculum_every = 0: the full task from step 0
    dims_start: int | None = None
    points_start: int | None = None
    dims_inc: int = 1
    points_inc: int = 2
    curriculum_every: int = 0
    ridge_lambda: float | None = None  # the ridge baseline's lambda; None: noise_std^2, or 1 when noiseless

    def __post_init__(self) -> None:
        require(isinstance(self.n_dims, int) and self.n_dims >= 1, "task.n_dims", "a positive integer (d >= 1)", self.n_dims)
        require(self.n_points is None or self.n_points >= 1, "task.n_points", "None or a positive integer (N >= 1)", self.n_points)
        require(self.noise_std >= 0, "task.noise_std", "a non-negative number", self.noise_std)
        require(self.sparsity is None or 1 <= self.sparsity <= self.n_dims, "task.sparsity",
                f"None or an integer in [1, task.n_dims={self.n_dims}]", self.sparsity)
        require(self.ridge_lambda is None or self.ridge_lambda > 0, "task.ridge_lambda", "None or a positive number",
                self.ridge_lambda)
        self.curriculum  # validates the curriculum fields with their own messages

    @property
    def points(self) -> int:
        return self.n_points if self.n_points is not None else 2 * self.n_dims + 1

    @property
    def seq_len(self) -> int:
        """Tokens of a full prompt: ``2N - 1`` (no token follows the last ``x``)."""
        return 2 * self.points - 1

    @property
    def ridge(self) -> float:
        if self.ridge_lambda is not None:
            return self.ridge_lambda
        return self.noise_std**2 if self.noise_std > 0 else 1.0

    @property
    def noise_to_signal(self) -> float:
        """Noise variance over the variance of a coordinate of ``w`` (``sparsity / d`` when sparse)."""
        return self.noise_std**2 / ((self.sparsity or self.n_dims) / self.n_dims)

    @property
    def curriculum(self) -> Curriculum:
        try:
            return Curriculum(
                dims=self.n_dims, points=self.points,
                dims_start=self.dims_start if self.dims_start is not None else self.n_dims,
                points_start=self.points_start if self.points_start is not None else self.points,
                dims_inc=self.dims_inc, points_inc=self.points_inc, every=self.curriculum_every,
            )
        except ValueError as e:
            raise ValueError(f"task: {e}") from None


@dataclass(frozen=True)
class ICLRunConfig(RunConfig):
    out_dir: str = "runs/icl"
    batch_size: int = 64


@dataclass(frozen=True)
class ICLConfig:
    model: TransformerConfig = field(default_factory=TransformerConfig)
    task: RegressionConfig = field(default_factory=RegressionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: ICLRunConfig = field(default_factory=ICLRunConfig)

    def __post_init__(self) -> None:
        require(self.model.max_seq_len >= self.task.seq_len, "model.max_seq_len",
                f"at least 2 * task.n_points - 1 = {self.task.seq_len}", self.model.max_seq_len)
        require(self.model.causal, "model.causal", "true (a prediction may only see the examples before it)",
                self.model.causal)
        self.model.check_attention()
        self.optim.check_model_mup(self.model.mup_base_width)


def load_icl_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ICLConfig:
    """An :class:`ICLConfig` from a YAML file (``None``: defaults) and ``section.key=value`` overrides."""
    return load_config(ICLConfig, path, overrides)


def build_icl_model(config: ICLConfig) -> RegressionTransformer:
    return RegressionTransformer(config.model, config.task.n_dims)


def load_icl(path: str | Path | LoadedCheckpoint, device: str | torch.device = "cpu"
             ) -> tuple[RegressionTransformer, ICLConfig, LoadedCheckpoint]:
    """``(model in eval mode, config, checkpoint)`` from an in-context regression checkpoint
    (:func:`~structured_attention.experiments.load_trained`)."""
    return load_trained(path, "icl", ICLConfig, build_icl_model, device)



def _prompts(task: RegressionConfig, batch_size: int, *, seed: int, index: int, active_dims: int | None = None,
             n_points: int | None = None, rank: int = 0, world_size: int = 1) -> Prompts:
    return sample_prompts(batch_size, n_points or task.points, task.n_dims, seed=seed, index=index,
                          active_dims=active_dims, noise_std=task.noise_std, sparsity=task.sparsity,
                          rank=rank, world_size=world_size)


def validation_prompts(config: ICLConfig, world_size: int = 1) -> Prompts:
    """``run.eval_batches`` global batches (``run.batch_size`` prompts per process, of
    ``world_size``) of full-size prompts from a stream that training never draws (the seed offset
    by 2**32), the same for every run with the same seed and global batch."""
    run = config.run
    return _prompts(config.task, run.batch_size * world_size * run.eval_batches, seed=run.seed + 2**32, index=0)


@torch.no_grad()
def model_predictions(model: nn.Module, prompts: Prompts, batch_size: int) -> torch.Tensor:
    device = next(model.parameters()).device
    preds = [model(prompts.xs[i:i + batch_size].to(device), prompts.ys[i:i + batch_size].to(device)).cpu()
             for i in range(0, prompts.xs.shape[0], batch_size)]
    return torch.cat(preds).double()


def normalised_errors(preds: torch.Tensor, prompts: Prompts) -> list[float]:
    """Squared error divided by ``d`` at each position (index ``i``: ``i`` in-context examples),
    averaged over prompts."""
    d = prompts.xs.shape[-1]
    return (((preds.double() - prompts.ys.double()) ** 2).mean(0) / d).tolist()


def error_curves(
    model: nn.Module | None, prompts: Prompts, ridge_lambda: float, batch_size: int = 256, noise_to_signal: float = 0.0,
    autocast: str = "none",
) -> dict[str, list[float]]:
    """Normalised MSE against the number of in-context examples for the model (``"model"``, when
    given; its predictions under ``autocast``, a ``run.autocast`` mode) and every baseline, on the
    same prompts (``noise_to_signal``: see :func:`.baselines.gradient_step`)."""
    curves = {}
    if model is not None:
        with autocast_context(autocast, next(model.parameters()).device):
            curves["model"] = normalised_errors(model_predictions(model, prompts, batch_size), prompts)
    for name, preds in baseline_predictions(prompts.xs, prompts.ys, ridge_lambda, noise_to_signal).items():
        curves[name] = normalised_errors(preds, prompts)
    return curves


def training_flops(model: TrainableModel, config: ICLConfig, steps: int) -> float:
    """Training FLOPs of ``steps`` optimizer steps on one process under the curriculum, each at its
    prompt length (:meth:`ICLTask.step_cost`, what the training loop counts): a stage of the
    curriculum at a time, its steps all costing the same (a sweep's budget matching asks for
    hundreds of thousands of steps, dozens of times)."""
    task, curriculum = ICLTask(config), config.task.curriculum
    total, start = 0.0, 0
    while start < steps:
        end = steps if start >= curriculum.full_at else min(steps, start + curriculum.every)
        total += (end - start) * task.step_cost(start, model)[1]
        start = end
    return total


class ICLTask(Task):
    """Fresh prompts every step (curriculum-sized), a fixed full-size validation set."""

    experiment = "icl"

    config: ICLConfig

    def __init__(self, config: ICLConfig) -> None:
        super().__init__(config)
        self.val: Prompts | None = None
        self._costs: dict[int, tuple[int, float]] = {}  # step_cost by points per prompt

    def setup(self, info: DistInfo) -> None:
        self.val = validation_prompts(self.config, self.world_size)

    def describe(self) -> str:
        t = self.config.task
        variant = (f"noise std {t.noise_std:g}" if t.noise_std else "noiseless") + (
            f", {t.sparsity}-sparse w" if t.sparsity else "")
        cur = t.curriculum
        schedule = (f"curriculum dims {cur.dims_start}->{cur.dims}, points {cur.points_start}->{cur.points}, "
                    f"full from step {cur.full_at}") if cur.full_at else "no curriculum"
        return (f"task: in-context linear regression, d={t.n_dims}, N={t.points} points ({variant}) | {schedule} | "
                f"attention {self.config.model.attention}, {self.config.model.n_heads} heads")

    def build_model(self) -> RegressionTransformer:
        return build_icl_model(self.config)

    def batch(self, index: int, rank: int, world_size: int, device: torch.device) -> tuple[Prompts, int]:
        run = self.config.run
        dims, points = self.config.task.curriculum.at(index // run.grad_accum)
        prompts = _prompts(self.config.task, run.batch_size, seed=run.seed, index=index, active_dims=dims,
                           n_points=points, rank=rank, world_size=world_size)
        return prompts.to(device), dims

    def loss(self, model: nn.Module, batch: tuple[Prompts, int]) -> torch.Tensor:
        prompts, dims = batch
        return ((model(prompts.xs, prompts.ys) - prompts.ys) ** 2).mean() / dims

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        assert self.val is not None
        errors = normalised_errors(model_predictions(model, self.val, self.config.run.batch_size), self.val)
        d = self.config.task.n_dims
        metrics = {"val_loss": sum(errors) / len(errors), "val_mse_last": errors[-1]}
        if d < len(errors):
            metrics["val_mse_at_d"] = errors[d]
        return metrics

    def backbone_config(self) -> TransformerConfig:
        return self.config.model

    def tokens_per_batch(self) -> int:
        # at the full prompt length (the memory check's worst case); step_cost counts the curriculum's
        return self.config.run.batch_size * self.config.task.seq_len

    def flops_per_token(self, model: TrainableModel) -> float:
        return model.training_flops_per_token(self.config.task.seq_len)

    def step_cost(self, step: int, model: TrainableModel) -> tuple[int, float]:
        """``batch_size x grad_accum`` prompts at the curriculum's length ``T = 2 points - 1``
        (shorter than the full task's at first), at ``model.training_flops_per_token(T)``."""
        points = self.config.task.curriculum.at(step)[1]
        if points not in self._costs:
            t = 2 * points - 1
            positions = self.config.run.batch_size * self.config.run.grad_accum * t
            self._costs[points] = (positions, positions * model.training_flops_per_token(t))
        return self._costs[points]


@dataclass(kw_only=True)
class ICLResult(FitResult):
    """What :func:`train_icl` returns: the loop's :class:`~structured_attention.training.FitResult`
    (its tokens and ``flops`` counted along the curriculum, :meth:`ICLTask.step_cost`, every
    rank's steps) and, on rank 0, the parameters and the error curves on the validation prompts."""

    curves: dict[str, list[float]] | None = None  # name ("model" and every baseline) -> normalised MSE per number of examples
    params: int | None = None

    @property
    def mse_last(self) -> float | None:
        """The model's normalised MSE with ``N - 1`` in-context examples (the last position)."""
        return self.curves["model"][-1] if self.curves is not None else None


def train_icl(config: ICLConfig, *, resume: bool = False, stream: TextIO | None = None) -> ICLResult:
    """Train an in-context regression model as ``config`` says (see :func:`training.fit`), then
    measure its error curve and the baselines' on the validation prompts."""
    task = ICLTask(config)
    result = fit(task, resume=resume, stream=stream)
    if result.model is None:
        return ICLResult.extend(result)
    assert task.val is not None
    model = result.model.eval()
    curves = error_curves(model, task.val, config.task.ridge, config.run.batch_size, config.task.noise_to_signal,
                          autocast=config.run.autocast)  # as the loop's evaluations ran
    return ICLResult.extend(result, curves=curves, params=sum(p.numel() for p in model.parameters()))
