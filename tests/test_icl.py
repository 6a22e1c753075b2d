"""In-context regression: prompt samplers, curriculum, baselines against independent computations,
the model's causality and loss positions, FLOP accounting, and a short training run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from structured_attention.data.regression import Curriculum, interleave, sample_prompts
from structured_attention.experiments.icl import (
    ICLTask,
    build_icl_model,
    error_curves,
    load_icl_config,
    train_icl,
    training_flops,
)
from structured_attention.experiments.icl.baselines import (
    averaging,
    best_gradient_descent,
    gradient_step,
    least_squares,
    nearest_neighbours,
    ridge,
)
from structured_attention.training.budget import steps_for_flops

# -- samplers ----------------------------------------------------------------------------------------


def test_gaussian_prompts_have_the_stated_statistics():
    p = sample_prompts(2000, 10, 6, seed=0, index=0)
    assert p.xs.shape == (2000, 10, 6) and p.ys.shape == (2000, 10) and p.ws.shape == (2000, 6)
    assert p.xs.mean().abs() < 0.02 and (p.xs.var() - 1).abs() < 0.02
    assert p.ws.mean().abs() < 0.05 and (p.ws.var() - 1).abs() < 0.05
    torch.testing.assert_close(p.ys, torch.einsum("bnd,bd->bn", p.xs, p.ws), rtol=1e-5, atol=1e-5)
    # E[y^2] = E||w||^2 = d: the reason errors are normalised by d
    assert abs(float((p.ys**2).mean()) / 6 - 1) < 0.05


def test_noisy_sparse_and_curriculum_variants():
    noisy = sample_prompts(4000, 8, 5, seed=1, index=3, noise_std=0.5)
    resid = noisy.ys - torch.einsum("bnd,bd->bn", noisy.xs, noisy.ws)
    assert abs(float(resid.std()) - 0.5) < 0.01 and abs(float(resid.mean())) < 0.01

    sparse = sample_prompts(500, 4, 10, seed=0, index=0, sparsity=3)
    assert ((sparse.ws != 0).sum(1) == 3).all()
    # each coordinate is kept equally often (a uniform subset per prompt)
    assert ((sparse.ws != 0).float().mean(0) - 0.3).abs().max() < 0.08

    part = sample_prompts(50, 4, 10, seed=0, index=0, active_dims=4)
    assert (part.xs[..., 4:] == 0).all() and (part.ws[:, 4:] == 0).all() and (part.xs[..., :4] != 0).all()


def test_prompts_are_a_pure_function_of_seed_and_index_and_shard_by_rank():
    a = sample_prompts(8, 5, 3, seed=7, index=11)
    b = sample_prompts(8, 5, 3, seed=7, index=11)
    c = sample_prompts(8, 5, 3, seed=7, index=12)
    assert torch.equal(a.xs, b.xs) and not torch.equal(a.xs, c.xs)
    whole = sample_prompts(8, 5, 3, seed=7, index=11, world_size=1)
    halves = [sample_prompts(4, 5, 3, seed=7, index=11, rank=r, world_size=2) for r in (0, 1)]
    assert torch.equal(torch.cat([h.xs for h in halves]), whole.xs)


def test_interleave_puts_x_then_y_in_the_first_coordinate_and_drops_the_last_y():
    xs = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    ys = -torch.arange(1, 7, dtype=torch.float32).view(2, 3)
    z = interleave(xs, ys)
    assert z.shape == (2, 5, 4)
    for i in range(3):
        assert torch.equal(z[:, 2 * i], xs[:, i])
    for i in range(2):
        assert torch.equal(z[:, 2 * i + 1, 0], ys[:, i]) and (z[:, 2 * i + 1, 1:] == 0).all()


def test_curriculum_schedule():
    c = Curriculum(dims=16, points=33, dims_start=4, points_start=17, dims_inc=2, points_inc=4, every=100)
    assert c.at(0) == (4, 17) and c.at(99) == (4, 17) and c.at(100) == (6, 21) and c.at(250) == (8, 25)
    assert c.at(400) == (12, 33) and c.at(600) == (16, 33) and c.at(10**6) == (16, 33)
    assert c.full_at == 600
    assert Curriculum(dims=5, points=9, dims_start=5, points_start=9, every=0).at(0) == (5, 9)


# -- baselines ---------------------------------------------------------------------------------------


def _prompts(b=6, n=9, d=4, noise=0.0):
    return sample_prompts(b, n, d, seed=3, index=0, noise_std=noise)


def test_least_squares_matches_the_closed_forms():
    p = _prompts(noise=0.3)
    pred = least_squares(p.xs, p.ys)
    x, y = p.xs.double(), p.ys.double()
    for i in range(1, 9):
        X, Y = x[:, :i], y[:, :i, None]
        if i >= 4:  # overdetermined: the normal equations
            w = torch.linalg.solve(X.mT @ X, X.mT @ Y)
        else:  # underdetermined: the minimum-norm interpolant X^T (X X^T)^-1 y
            w = X.mT @ torch.linalg.solve(X @ X.mT, Y)
        torch.testing.assert_close(pred[:, i], (x[:, i, None] @ w)[:, 0, 0])
    assert (pred[:, 0] == 0).all()


def test_ridge_matches_the_augmented_least_squares_problem():
    p, lam = _prompts(noise=0.5), 0.25
    pred = ridge(p.xs, p.ys, lam)
    x, y = p.xs.double(), p.ys.double()
    for i in range(1, 9):
        aug_x = torch.cat([x[:, :i], math.sqrt(lam) * torch.eye(4, dtype=x.dtype).expand(6, 4, 4)], 1)
        aug_y = torch.cat([y[:, :i], torch.zeros(6, 4, dtype=y.dtype)], 1)
        w = torch.linalg.lstsq(aug_x, aug_y[..., None]).solution
        torch.testing.assert_close(pred[:, i], (x[:, i, None] @ w)[:, 0, 0])


def test_nearest_neighbours_and_averaging_match_brute_force_loops():
    p = _prompts(b=3, n=7, d=2)
    knn, avg = nearest_neighbours(p.xs, p.ys, 3), averaging(p.xs, p.ys)
    x, y = p.xs.double().numpy(), p.ys.double().numpy()
    for b in range(3):
        for i in range(7):
            dists = [float(np.linalg.norm(x[b, j] - x[b, i])) for j in range(i)]
            nearest = sorted(range(i), key=lambda j: dists[j])[:3]
            expect = float(np.mean([y[b, j] for j in nearest])) if i else 0.0
            assert float(knn[b, i]) == pytest.approx(expect, abs=1e-9)
            w = sum(y[b, j] * x[b, j] for j in range(i)) / max(i, 1)
            assert float(avg[b, i]) == pytest.approx(float(np.dot(w, x[b, i])) if i else 0.0, abs=1e-9)


@pytest.mark.parametrize("noise_std, sparsity", [(0.0, None), (1.0, None), (0.0, 2)])
def test_the_gradient_step_baseline_reaches_its_analytic_error_and_its_step_size_is_the_best(noise_std, sparsity):
    d, n = 4, 9
    p = sample_prompts(40000, n, d, seed=5, index=0, noise_std=noise_std, sparsity=sparsity)
    rho = (sparsity or d) / d
    k = noise_std**2 / rho
    err = lambda preds: ((preds - p.ys.double()) ** 2).mean(0)  # noqa: E731
    got = err(gradient_step(p.xs, p.ys, k))
    for i in (2, 5, 8):
        # the error in w times rho, plus the noise of y_i itself
        expect = rho * d * (d + 1 + k) / (i + d + 1 + k) + noise_std**2
        assert float(got[i]) == pytest.approx(expect, rel=0.03)
    # a step 20 % shorter or longer does worse: the expected error is a parabola in the step size
    ws = torch.cumsum(p.ys.double()[..., None] * p.xs.double(), 1) - p.ys.double()[..., None] * p.xs.double()
    raw = (ws * p.xs.double()).sum(-1)
    for factor in (0.8, 1.2):
        other = err(raw * factor / (torch.arange(n) + d + 1 + k))
        assert (other[2:] > got[2:]).all()


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_best_gradient_descent_matches_running_its_steps_on_fresh_prompts(steps):
    d, n = 6, 12
    error, step_sizes = best_gradient_descent(d, n, steps, samples=4000, seed=0)
    assert len(step_sizes) == steps
    if steps == 1:
        assert error == pytest.approx((d + 1) / (n + d + 1), rel=0.02)
    # run the steps on other prompts: w <- w - eta X^T (X w - y) / n from zero
    p = sample_prompts(20000, n, d, seed=3, index=0)
    x, y, w_true = p.xs.double(), p.ys.double(), p.ws.double()

    def run(etas: list[float]) -> float:
        w = torch.zeros_like(w_true)
        for eta in etas:
            w = w - eta * torch.einsum("bnd,bn->bd", x, torch.einsum("bnd,bd->bn", x, w) - y) / n
        return float(((w - w_true) ** 2).sum(1).mean()) / d

    measured = run(step_sizes)
    assert measured == pytest.approx(error, rel=0.03)
    # the step sizes are the best: 10 % more or less on any one of them does worse
    for t in range(steps):
        for factor in (0.9, 1.1):
            assert run([eta * factor if i == t else eta for i, eta in enumerate(step_sizes)]) > measured
    if steps > 1:  # and one more step lowers the floor
        assert error < best_gradient_descent(d, n, steps - 1, samples=4000, seed=0)[0]


# -- the model and the task --------------------------------------------------------------------------

TINY = ["task.n_dims=4", "task.n_points=9", "model.max_seq_len=17", "model.d_model=16", "model.n_heads=2",
        "model.n_layers=2", "run.batch_size=16", "run.eval_batches=2"]


@pytest.mark.parametrize("attention", ["mha", "bilinear_btt:1", "bilinear_mlr:4|2"])
def test_a_prediction_sees_only_the_examples_before_it_and_its_own_x(attention):
    model = build_icl_model(load_icl_config(None, [*TINY, f"model.attention={attention}"])).eval()
    p = _prompts(b=2, n=9, d=4)
    with torch.no_grad():
        base = model(p.xs, p.ys)
        for i in (0, 4, 8):
            ys = p.ys.clone()
            ys[:, i] += 5.0  # its own target, and everything after it, must not matter
            xs = p.xs.clone()
            xs[:, i + 1:] += 3.0
            torch.testing.assert_close(model(xs, ys)[:, :i + 1], base[:, :i + 1])
            xs = p.xs.clone()
            xs[:, i] += 1.0
            assert not torch.allclose(model(xs, p.ys)[:, i], base[:, i])


def test_the_loss_is_the_squared_error_of_the_y_predictions_over_active_dims():
    cfg = load_icl_config(None, [*TINY, "task.dims_start=2", "task.points_start=5", "task.curriculum_every=10"])
    task = ICLTask(cfg)
    model = build_icl_model(cfg)
    prompts, dims = task.batch(0, 0, 1, torch.device("cpu"))
    assert dims == 2 and prompts.xs.shape == (16, 5, 4) and (prompts.xs[..., 2:] == 0).all()
    with torch.no_grad():
        expected = ((model(prompts.xs, prompts.ys) - prompts.ys) ** 2).mean() / 2
        assert float(task.loss(model, (prompts, dims))) == pytest.approx(float(expected), rel=1e-6)
    late, dims = task.batch(10**4, 0, 1, torch.device("cpu"))
    assert dims == 4 and late.xs.shape == (16, 9, 4)


def test_training_flops_follow_the_curriculum():
    cfg = load_icl_config(None, [*TINY, "task.points_start=5", "task.points_inc=2", "task.curriculum_every=3"])
    model = build_icl_model(cfg)
    per_pos = model.training_flops_per_token
    # points 5, 5, 5, 7, 7, 7, 9 ... -> prompts of 9, 13, 17 tokens
    expect = 16 * (3 * 9 * per_pos(9) + 3 * 13 * per_pos(13) + 4 * 17 * per_pos(17))
    assert training_flops(model, cfg, 10) == pytest.approx(expect)
    assert training_flops(model, cfg, 4) == pytest.approx(16 * (3 * 9 * per_pos(9) + 13 * per_pos(13)))  # mid-stage
    assert training_flops(model, cfg, 0) == 0
    backbone = model.backbone.forward_flops_per_position(17)
    assert model.forward_flops_per_token(17) == pytest.approx(4 * 16 + backbone + 16 * 9 / 17)
    budget = training_flops(model, cfg, 40)
    flops_after = lambda steps: training_flops(model, cfg, steps)  # noqa: E731
    assert steps_for_flops(budget, flops_after) == 40
    assert steps_for_flops(budget + 0.4 * 16 * 17 * per_pos(17), flops_after) == 40
    assert steps_for_flops(budget + 0.6 * 16 * 17 * per_pos(17), flops_after) == 41


def test_the_runs_metrics_count_the_curriculums_prompts(tmp_path):
    """metrics.jsonl's tokens and FLOPs (and so tokens/s) follow the curriculum's prompt lengths,
    as the result does: they counted every step at the full length (38 % over in a short run)."""
    cfg = load_icl_config(None, [*TINY, "task.points_start=5", "task.points_inc=2", "task.curriculum_every=3",
                                 "run.steps=10", "run.log_every=1", "run.eval_every=0", f"run.out_dir={tmp_path}"])
    result = train_icl(cfg)
    model = build_icl_model(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lengths = [2 * cfg.task.curriculum.at(step)[1] - 1 for step in range(10)]  # 9, 9, 9, 13, ...
    assert [r["tokens"] for r in rows] == [16 * sum(lengths[:r["step"]]) for r in rows]
    for r in rows:
        assert r["flops"] == pytest.approx(sum(16 * t * model.training_flops_per_token(t) for t in lengths[:r["step"]]))
    assert result.flops == pytest.approx(training_flops(model, cfg, 10)) and result.tokens == rows[-1]["tokens"]


def test_error_curves_score_the_model_and_every_baseline_on_the_same_prompts():
    p = _prompts(b=64, n=9, d=4)
    model = build_icl_model(load_icl_config(None, TINY)).eval()
    curves = error_curves(model, p, ridge_lambda=1.0, batch_size=16)
    assert set(curves) == {"model", "least_squares", "ridge", "3nn", "averaging", "gd_step"}
    assert all(len(c) == 9 for c in curves.values())
    assert max(curves["least_squares"][4:]) < 1e-10  # noiseless and N > d: exact
    expected = ((averaging(p.xs, p.ys) - p.ys.double()) ** 2).mean(0) / 4
    assert curves["averaging"] == pytest.approx(expected.tolist())


def test_a_short_training_run_learns_in_context(tmp_path):
    # d = 1 with up to 16 examples: 300 steps of a tiny model learn to use the examples -- below the
    # zero predictor (error ~1) from the second example on, and better than the averaging
    # estimator (w = mean y_j x_j) over the prompt.
    cfg = load_icl_config(None, [
        "task.n_dims=1", "task.n_points=17", "model.max_seq_len=33", "model.d_model=32", "model.n_heads=1",
        "model.n_layers=2", "model.qk_norm=true", "optim.lr=1e-3", "optim.weight_decay=0", "optim.warmup_steps=20",
        "run.steps=300", "run.batch_size=32", "run.eval_every=0", "run.eval_batches=8", f"run.out_dir={tmp_path}",
    ])
    result = train_icl(cfg)
    model, avg = result.curves["model"], result.curves["averaging"]
    assert sum(result.losses[-20:]) < 0.5 * sum(result.losses[:20])
    assert max(model[2:]) < 0.5
    assert sum(model[1:]) < sum(avg[1:])
    assert result.flops == pytest.approx(training_flops(build_icl_model(cfg), cfg, 300))
