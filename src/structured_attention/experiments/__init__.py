"""The experiments (docs/design.md, 'Experiments'), each a
:class:`~structured_attention.training.Task` for the shared training loop plus its config and entry
points:

- :mod:`structured_attention.experiments.lm`: byte/char-level language modelling;
- :mod:`structured_attention.experiments.icl`: in-context linear regression (baselines in
  :mod:`structured_attention.experiments.icl_baselines`);
- :mod:`structured_attention.experiments.forecasting`: long-range time-series forecasting (ETT).
"""
