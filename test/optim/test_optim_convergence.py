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


# Measured (120 steps, seed 0): fp32 0.193; 4bit 0.200 (+3.4%) with stochastic rounding of m (the default
# for 4bit first moments; compiled kernels +2.3%), 0.218 (+12.7%) with round-to-nearest (NF4 map), 0.267
# (+38%) with the 4-bit dynamic map; v alone in 4bit +2%. Round-to-nearest of the EMA
# m <- m + 0.1 (g - m) never moves a code while 0.1 |g - m| is under half a map step, so m lags its fp32
# value; no 16-entry map removes that (linear: +16%), unbiased rounding of m does. Seeds 1, 2: +3.4%,
# +2.7% (nearest +12.7%, +10.9%).
@pytest.mark.parametrize("fmt,tol", [("8bit", 0.02), ("4bit", 0.05), ("fp8", 0.05)])
def test_adamw_quantized_converges_like_fp32(fmt, tol):
    ref = _reference("adamw")
    got = _adamw_quantized(fmt)
    assert ref < 0.3  # it did learn
    assert got <= ref * (1 + tol), (fmt, got, ref)


def test_adamw_4bit_gap_is_bounded():
    # guards the 4-bit map choice under round-to-nearest (state_rounding="nearest": +12.7%; the signed
    # dynamic map was +38%), and that stochastic rounding of m (the default) is what closes the gap
    ref = _reference("adamw")
    nearest = _final_loss(lambda p: AdamW(p, lr=1e-3, state_format="4bit", state_rounding="nearest",
                                          min_quantize_numel=512, compile=False))
    assert nearest <= ref * 1.2, (nearest, ref)
    assert _adamw_quantized("4bit") < ref + (nearest - ref) / 2, (_adamw_quantized("4bit"), nearest, ref)


def test_lion_8bit_converges_like_fp32():
    ref = _reference("lion")
    got = _final_loss(lambda p: Lion(p, lr=1e-3, weight_decay=0.1, state_format="8bit", min_quantize_numel=512,
                                     compile=False))
    assert ref < 0.3
    assert got <= ref * 1.02, (got, ref)
