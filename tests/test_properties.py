"""Property-based tests (hypothesis) over random arguments: random shapes, ranks, block sizes and
dtypes for the matrices and MLR attention, random config documents. Every call either succeeds and
matches an independent computation, or raises ``ValueError`` with one line naming the parameter;
no other exception escapes."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from structured_attention.experiments.lm import load_lm_config
from structured_attention.functional import mlr_attention, mlr_attention_reference
from structured_attention.ops.mlr.blocked import mlr_attention_blocked
from structured_attention.matrices import BTT, MLR, BlockDiag, Dense, Kronecker, LowRank, Monarch

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
ints = st.integers(-3, 40)  # invalid (<= 0) values included on purpose


def _one_line_value_error(err: ValueError, names: tuple[str, ...]) -> None:
    text = str(err)
    assert "\n" not in text and any(text.startswith(n) or f"{n}:" in text or f"{n}=" in text for n in names), text


# -- MLR attention --------------------------------------------------------------------------------


@st.composite
def mlr_call(draw):
    """Arguments for mlr_attention, valid or not."""
    T = draw(st.integers(1, 48))
    ranks = draw(st.lists(st.integers(-1, 6), min_size=0, max_size=4))
    R = draw(st.sampled_from([max(sum(ranks), 1), max(sum(ranks), 1) + draw(st.integers(-2, 2))]))
    if draw(st.booleans()):
        sizes = None
    else:
        top = draw(st.sampled_from([T, T + draw(st.integers(-3, 20)), 2 ** max(T - 1, 0).bit_length()]))
        sizes = [top]
        for _ in range(len(ranks) - 1 + draw(st.integers(-1, 1))):
            sizes.append(max(sizes[-1] // draw(st.sampled_from([1, 2, 3, 4])), draw(st.integers(-1, 1))))
    H = draw(st.integers(1, 4))
    Hk = draw(st.sampled_from([H, 1, 2, 3]))
    return dict(T=T, ranks=ranks, R=max(R, 1), sizes=sizes, H=H, Hk=Hk, Dv=draw(st.integers(1, 6)),
                causal=draw(st.booleans()), dn=draw(st.booleans()), dtype=draw(st.sampled_from(DTYPES)),
                scale=draw(st.sampled_from([None, 0.5, 2.0])))


@pytest.mark.parametrize("fn", [mlr_attention, mlr_attention_blocked], ids=["dispatched", "blocked"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=mlr_call(), seed=st.integers(0, 2**16))
def test_mlr_attention_matches_the_reference_or_names_the_parameter(fn, call, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, call["H"], call["T"], call["R"], generator=g, dtype=torch.float64)
    k = torch.randn(1, call["Hk"], call["T"], call["R"], generator=g, dtype=torch.float64)
    v = torch.randn(1, call["Hk"], call["T"], call["Dv"], generator=g, dtype=torch.float64)
    args = (call["ranks"], call["sizes"], call["causal"], call["scale"], call["dn"])
    try:
        ref = mlr_attention_reference(q, k, v, *args)
    except ValueError as err:
        _one_line_value_error(err, ("ranks", "block_sizes", "k", "q", "v"))
        with pytest.raises(ValueError):  # the fast path refuses the same input
            fn(*(x.to(call["dtype"]) for x in (q, k, v)), *args)
        return
    dtype = call["dtype"]
    out = fn(*(x.to(dtype) for x in (q, k, v)), *args)
    assert out.dtype == dtype and out.shape == ref.shape and torch.isfinite(out).all()
    # against the reference on the same rounded inputs, computed in float64
    exact = mlr_attention_reference(*(x.to(dtype).double() for x in (q, k, v)), *args)
    torch.testing.assert_close(out.double(), exact, atol=TOL[dtype], rtol=TOL[dtype])


# -- structured matrices --------------------------------------------------------------------------

MATRICES = {
    "Dense": lambda a, b, c, d: Dense(a, b),
    "LowRank": lambda a, b, c, d: LowRank(a, b, rank=c),
    "BlockDiag": lambda a, b, c, d: BlockDiag(a, b, n_blocks=c),
    "MLR": lambda a, b, c, d: MLR(a, b, ranks=(c, d)),
    "BTT": lambda a, b, c, d: BTT(a, b, tt_rank=c),
    "Monarch": lambda a, b, c, d: Monarch(a, b),
    "Kronecker": lambda a, b, c, d: Kronecker(a, b, c, d),
}


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(MATRICES)), a=ints, b=ints, c=ints, d=ints, batch=st.integers(1, 3),
       dtype=st.sampled_from([torch.float64, torch.float32]))
def test_matrices_equal_their_dense_form_or_name_the_parameter(name, a, b, c, d, batch, dtype):
    try:
        m = MATRICES[name](a, b, c, d)
    except ValueError as err:
        assert "\n" not in str(err) and ": expected " in str(err), str(err)
        return
    m = m.to(dtype)
    x = torch.randn(batch, m.in_features, dtype=dtype)
    dense = m.to_dense()
    assert dense.shape == (m.out_features, m.in_features)
    torch.testing.assert_close(m(x), x @ dense.T, atol=1e-4 if dtype == torch.float32 else 1e-10, rtol=1e-4)
    assert m.num_params == sum(p.numel() for p in m.parameters())
    assert torch.linalg.matrix_rank(m.double().to_dense()) <= m.rank_bound  # in float64: no rounding noise
    m = m.to(dtype)
    with pytest.raises(ValueError, match="x"):
        m(torch.randn(batch, m.in_features + 1, dtype=dtype))


# -- config documents ------------------------------------------------------------------------------

_KEYS = ["d_model", "n_layers", "n_heads", "max_seq_len", "attention", "positions", "lr", "steps", "seq_len",
         "batch_size", "source", "tokenizer", "val_fraction", "warmup_steps", "schedule", "bogus"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 2000), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["mha", "mlr:8|8", "mlr:3|3", "swa:-1", "char", "rotary"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=5)
documents = st.one_of(
    st.dictionaries(st.sampled_from(["model", "data", "optim", "run", "extra"]),
                    st.one_of(values, st.dictionaries(st.sampled_from(_KEYS), values, max_size=4)), max_size=4),
    values,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=documents, raw=st.one_of(st.none(), st.text(max_size=40)))
@example(doc={"model": {"\n": None}}, raw=None)  # a key holding a line break
@example(doc={"model": {"d_model": 2**31}}, raw=None)  # weights whose byte count overflows int64
def test_any_config_document_loads_or_fails_in_one_line(tmp_path, doc, raw):
    path = tmp_path / "c.yaml"
    path.write_text(raw if raw is not None else yaml.safe_dump(doc, allow_unicode=True))
    try:
        config = load_lm_config(path)
    except (ValueError, FileNotFoundError) as err:
        assert "\n" not in str(err).strip(), str(err)
        return
    assert config.model.d_model > 0 and config.run.steps > 0  # a valid config is a typed, checked one
