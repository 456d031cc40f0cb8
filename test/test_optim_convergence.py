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


@functools.lru_cache(maxsize=None)
def _reference(kind: str) -> float:
    if kind == "adamw":
        return _final_loss(lambda p: AdamW(p, lr=1e-3, state_format="fp32", compile=False))
    return _final_loss(lambda p: Lion(p, lr=1e-3, weight_decay=0.1, state_format="fp32", compile=False))


# min_quantize_numel=512: the three weight matrices (8192, 8192, 640 elements) are quantized
FOUR_BIT_M = pytest.mark.xfail(
    reason="known: the 16-entry signed dynamic map rounds away small first-moment increments "
    "(m in 4bit, v in fp32: +37% final loss; m fp32, v 4bit: +2%); needs unbiased (stochastic) "
    "rounding or another signed 4-bit map in qstate/formats", strict=False)


@pytest.mark.parametrize("fmt,tol", [("8bit", 0.02), pytest.param("4bit", 0.05, marks=FOUR_BIT_M), ("fp8", 0.05)])
def test_adamw_quantized_converges_like_fp32(fmt, tol):
    ref = _reference("adamw")
    got = _final_loss(lambda p: AdamW(p, lr=1e-3, state_format=fmt, min_quantize_numel=512, compile=False))
    assert ref < 0.3  # it did learn
    assert got <= ref * (1 + tol), (fmt, got, ref)


def test_lion_8bit_converges_like_fp32():
    ref = _reference("lion")
    got = _final_loss(lambda p: Lion(p, lr=1e-3, weight_decay=0.1, state_format="8bit", min_quantize_numel=512,
                                     compile=False))
    assert ref < 0.3
    assert got <= ref * 1.02, (got, ref)
