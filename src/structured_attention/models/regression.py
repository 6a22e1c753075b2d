"""The in-context regression model (Garg et al. 2022): a linear read-in of the interleaved prompt
``x_1, y_1, ..., x_N`` (see :func:`structured_attention.data.regression.interleave`), the shared
causal :class:`Transformer` backbone with any attention kind, and a linear read-out that predicts
``y_i`` at the token of ``x_i``."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import require
from ..data.regression import interleave
from ..matrices.base import Fan
from .transformer import Transformer, TransformerConfig, init_gpt2_, mup_init_, parameter_fans

__all__ = ["RegressionTransformer"]


class RegressionTransformer(nn.Module):
    """``n_dims`` is ``d``, the dimension of ``x``; ``config`` describes the backbone, which must be
    causal (a prediction may only see the examples before it)."""

    def __init__(self, config: TransformerConfig, n_dims: int) -> None:
        super().__init__()
        require(isinstance(n_dims, int) and n_dims >= 1, "n_dims", "a positive integer", n_dims)
        require(config.causal, "causal", "True (a prediction may only see the examples before it)", config.causal)
        self.config = config
        self.n_dims = n_dims
        self.read_in = nn.Linear(n_dims, config.d_model)
        self.backbone = Transformer(config)
        self.read_out = nn.Linear(config.d_model, 1)
        init_gpt2_(self, config)
        if config.mup_base_width is not None:
            mup_init_(self, config, lambda c: RegressionTransformer(c, n_dims), readout="read_out.weight")

    def forward(self, xs: torch.Tensor, ys: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predictions ``(B, N)`` of ``ys`` for prompts ``xs: (B, N, n_dims)``, ``ys: (B, N)``; the
        prediction of ``y_i`` sees ``(x_j, y_j)`` for ``j < i`` and ``x_i`` only. Prompts with
        fewer points go padded (left or right) with ``attention_mask`` ``(B, N)``, 1 or True for
        real points: each prompt is then predicted as if alone, and predictions at padding are 0."""
        require(xs.dim() == 3 and xs.shape[-1] == self.n_dims, "xs",
                f"a (batch, n_points, n_dims={self.n_dims}) tensor", tuple(xs.shape))
        tokens = interleave(xs, ys)
        token_mask = None
        if attention_mask is not None:
            require(isinstance(attention_mask, torch.Tensor) and tuple(attention_mask.shape) == tuple(ys.shape),
                    "attention_mask", f"shape (batch, n_points) = {tuple(ys.shape)}",
                    getattr(attention_mask, "shape", attention_mask))
            token_mask = attention_mask.repeat_interleave(2, dim=1)[:, :-1]  # a point's x and y tokens
        features = self.backbone(self.read_in(tokens), attention_mask=token_mask)
        predictions = self.read_out(features[:, ::2])[..., 0]
        return predictions if attention_mask is None else predictions * attention_mask.to(predictions.dtype)

    # -- accounting ----------------------------------------------------------------------------
    def forward_flops_per_token(self, seq_len: int | None = None) -> float:
        """Multiply-adds per position of one forward over a ``seq_len``-token prompt: the read-in,
        the backbone (:meth:`Transformer.forward_flops_per_position`) and the read-out, which runs
        at the ``(seq_len + 1) // 2`` ``x`` tokens only (``None``: the context, ``max_seq_len``)."""
        seq_len = self.config.max_seq_len if seq_len is None else seq_len
        d = self.config.d_model
        read_out = d * ((seq_len + 1) // 2) / seq_len
        return self.n_dims * d + self.backbone.forward_flops_per_position(seq_len) + read_out

    def training_flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per position: 2 FLOPs per multiply-add, times 3 for forward and backward."""
        return 6 * self.forward_flops_per_token(seq_len)

    def parameter_fans(self) -> dict[str, Fan]:
        """Fan-in/fan-out of every matrix-like parameter (for muP); see :func:`parameter_fans`."""
        return parameter_fans(self)
