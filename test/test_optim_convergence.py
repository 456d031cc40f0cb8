"""Convergence on real data: an MLP on scikit-learn's bundled digits (no download), quantized vs fp32."""

from __future__ import annotations

import functools

import pytest
import torch

from qstate.optim import AdamW, Lion

sklearn_datasets = pytest.importorskip("sklearn.datasets")

STEPS = 120


@functools.lru_cache(maxsize=None)
def _digits():
    data = sklearn_datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    return x, y


def _final_loss(make_opt) -> float:
    x, y = _digits()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 10))
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        idx = torch.randint(0, x.shape[0], (256,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


def _adamw(fmt: str):
    # min_quantize_numel=512: the three weight matrices (8192, 8192, 640 elements) are quantized
    return lambda p: AdamW(p, lr=1e-3, state_format=fmt, min_quantize_numel=512, compile=False)


@functools.lru_cache(maxsize=None)
def _reference(kind: str) -> float:
    if kind == "adamw":
        return _final_loss(_adamw("fp32"))
    return _final_loss(lambda p: Lion(p, lr=1e-3, weight_decay=0.1, state_format="fp32", compile=False))


@functools.lru_cache(maxsize=None)
def _adamw_quantized(fmt: str) -> float:
    return _final_loss(_adamw(fmt))


# Measured (120 steps): fp32 0.193; 4bit 0.218 (+13%) with the NF4 map for m, 0.267 (+38%) with the 4-bit
# dynamic map; m alone in 4bit gives the same, v alone +2%. Cause: round-to-nearest of the EMA
# m <- m + 0.1 (g - m) never moves a code while 0.1 |g - m| is under half a map step, so m lags its
# fp32 value; no 16-entry map removes that (linear: +16%), stochastic rounding of m does (+3..4%).
FOUR_BIT_M = pytest.mark.xfail(
    reason="known: round-to-nearest of the 4-bit first moment stalls small EMA increments (+13% final loss); "
    "needs unbiased (stochastic) rounding of signed 4-bit states", strict=False)


@pytest.mark.parametrize("fmt,tol", [("8bit", 0.02), pytest.param("4bit", 0.05, marks=FOUR_BIT_M), ("fp8", 0.05)])
def test_adamw_quantized_converges_like_fp32(fmt, tol):
    ref = _reference("adamw")
    got = _adamw_quantized(fmt)
    assert ref < 0.3  # it did learn
    assert got <= ref * (1 + tol), (fmt, got, ref)


def test_adamw_4bit_gap_is_bounded():
    # guards the 4-bit map choice until the xfail above is fixed: the signed dynamic map was +38%
    ref, got = _reference("adamw"), _adamw_quantized("4bit")
    assert got <= ref * 1.2, (got, ref)


def test_lion_8bit_converges_like_fp32():
    ref = _reference("lion")
    got = _final_loss(lambda p: Lion(p, lr=1e-3, weight_decay=0.1, state_format="8bit", min_quantize_numel=512,
                                     compile=False))
    assert ref < 0.3
    assert got <= ref * 1.02, (got, ref)
