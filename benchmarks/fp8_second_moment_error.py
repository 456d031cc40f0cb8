"""How far an fp8 second moment read back is from the true one: range and EMA rounding, per layer.

Trains the digits MLP 64-384-192-10 (batch 64, AdamW lr 1e-3, wd 0.01) with an Adam step written
out in Python whose moments of tensors of 1024+ elements are written to fp8 states with
``rounding`` (``qstate.quantize``, block 256) and read back after every step, and keeps an fp32
shadow EMA of the same gradients. At steps 30, 100 and 300 it prints, per weight matrix:

* *range*: the shadow ``v`` written to an fp8 state once: the 1st / 50th / 99th percentile and the
  largest ``|sqrt(v_read) / sqrt(v) - 1|``, and the share of elements below e4m3's normal range
  relative to their block's absmax (``2**-6 / 448``);
* *drift*: ``sqrt(v_stored / v_shadow)``, 1st / 50th / 99th percentile: how far the stored EMA
  has wandered from the one the same gradients give in fp32.

    python benchmarks/fp8_second_moment_error.py [--rounding nearest|stochastic] [--seed 2]
"""

from __future__ import annotations

import argparse
import math

import torch

import _common  # noqa: F401  (puts this checkout's qstate first on the path)
import qstate
from bench_quality import digits, mlp
from qstate.formats import position_hash32, state_key

BETAS = (0.9, 0.999)
LR, WEIGHT_DECAY, EPS = 1e-3, 0.01, 1e-8
REPORT_STEPS = (30, 100, 300)


def _read_back(v: torch.Tensor, signed: bool, rounding: str, key: int) -> torch.Tensor:
    rows = v.reshape(v.shape[0], -1)
    draws = position_hash32(key, torch.arange(rows.numel()).view(rows.shape)) if rounding == "stochastic" else None
    fmt = qstate.formats.get_format("fp8")
    codes, scale = fmt.encode(rows, 256, signed, None, rounding=rounding, draws=draws)
    return fmt.decode(codes, scale, rows.shape[1], 256, None).view(v.shape)


def _quantiles(x: torch.Tensor) -> str:
    q = x.quantile(torch.tensor([0.01, 0.5, 0.99]))
    return " / ".join(f"{float(a):.3f}" for a in q)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounding", default="stochastic", choices=["nearest", "stochastic"],
                    help="the second moment's rounding (the first moment rounds to nearest)")
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = mlp((384, 192))
    x, y = digits()
    gen = torch.Generator().manual_seed(args.seed)
    keys = torch.Generator().manual_seed(1000 + args.seed)
    b1, b2 = BETAS
    state = {p: dict(m=torch.zeros_like(p), v=torch.zeros_like(p), shadow=torch.zeros_like(p))
             for p in model.parameters()}
    for t in range(1, max(REPORT_STEPS) + 1):
        idx = torch.randint(0, x.shape[0], (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        model.zero_grad()
        loss.backward()
        key = int(torch.randint(0, 2**62, (1,), generator=keys))
        with torch.no_grad():
            for p in model.parameters():
                s, g = state[p], p.grad
                p.mul_(1 - LR * WEIGHT_DECAY)
                m = s["m"].lerp(g, 1 - b1)
                v = s["v"] * b2 + (1 - b2) * g * g
                s["shadow"] = s["shadow"] * b2 + (1 - b2) * g * g
                p.addcdiv_(m, v.sqrt() / math.sqrt(1 - b2**t) + EPS, value=-LR / (1 - b1**t))
                if p.numel() >= 1024:
                    m = _read_back(m, True, "nearest", 0)
                    v = _read_back(v, False, args.rounding, state_key(key, 1))
                s["m"], s["v"] = m, v
        if t not in REPORT_STEPS:
            continue
        print(f"step {t} (second moments rounded {args.rounding})")
        for name, p in model.named_parameters():
            if p.numel() < 1024:
                continue
            shadow, stored = state[p]["shadow"].flatten(), state[p]["v"].flatten()
            pos = shadow > 0
            once = _read_back(state[p]["shadow"], False, "nearest", 0).flatten()
            err = ((once[pos] / shadow[pos]).sqrt() - 1).abs()
            blocks = torch.nn.functional.pad(shadow, (0, -shadow.numel() % 256)).view(-1, 256)
            rel = (blocks / blocks.amax(-1, keepdim=True).clamp_min(1e-38)).flatten()[:shadow.numel()][pos]
            print(f"  {name:9s} range: |sqrt ratio - 1| {_quantiles(err)}, max {float(err.max()):.2f}; "
                  f"below normal {float((rel < 2**-6 / 448).float().mean()):.3f}   "
                  f"drift: {_quantiles((stored[pos] / shadow[pos]).sqrt())}")


if __name__ == "__main__":
    main()
