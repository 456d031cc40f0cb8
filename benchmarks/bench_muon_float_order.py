"""How far float-order noise in gradients moves Muon's parameters, per momentum format and rounding.

An FSDP2 run on ``--world-size`` gloo ranks, each rank feeding its own third
(half, ...) of every batch, is compared with an unsharded run on whole
batches: FSDP2's gradient is the average of the ranks' batch means, the
unsharded one the mean of the whole batch, the same number summed in
another order. After ``--steps`` steps the table gives, over the 2-D
parameters, the largest and the RMS difference between the two runs'
parameters, in units of the learning rate, and the ratio of the RMS to the
same figure of the float32-state run (Muon's bfloat16 Newton-Schulz alone)
and of ``4bit`` round-to-nearest. AdamW rows (``adamw``) give the same
figures for qstate's AdamW, whose update has no bfloat16 step.

A second table (one process, 4bit momentum) compares the state's roundings
with a prototype that qstate does not ship: stochastic rounding onto the same
map whose draws are keyed by each element's index and the step instead of
hashed from its value (``position_keyed``), so a small change of a value
changes its code with a probability proportional to the change, as with
round-to-nearest. Its gradients differ in float order the same way: three
microbatch means averaged against one whole-batch mean. Writes JSON.

    python benchmarks/bench_muon_float_order.py [--world-size 3] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.nn as nn

from _common import RESULTS_DIR, environment, save_json

import qstate
import qstate.optim
from qstate.launch import run_ranks

#: (optimizer, state_format, state_rounding)
CASES = [
    ("muon", "fp32", None), ("muon", "bf16", None), ("muon", "8bit", "nearest"), ("muon", "8bit", "stochastic"),
    ("muon", "4bit", "nearest"), ("muon", "4bit", "stochastic"), ("muon", "fp8", "nearest"),
    ("adamw", "fp32", None), ("adamw", "4bit", "nearest"), ("adamw", "4bit", "stochastic"),
]
LR = {"muon": 0.02, "adamw": 2e-3}
BATCH = 48


def model() -> nn.Module:
    torch.manual_seed(0)  # first dims 128, 64, 10: uneven on 3 ranks
    return nn.Sequential(nn.Linear(96, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 10))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 96, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def optimizer(params, kind: str, fmt: str, rounding) -> torch.optim.Optimizer:
    policy = dict(state_format=fmt, min_quantize_numel=0, compile=False)
    if rounding is not None:
        policy["state_rounding"] = rounding
    if kind == "muon":
        return qstate.optim.Muon(params, lr=LR[kind], **policy)
    return qstate.optim.AdamW(params, lr=LR[kind], **policy)


def body(rank: int, world_size: int, steps: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    rows = []
    for kind, fmt, rounding in CASES:
        sharded, whole = model(), model()
        for layer in sharded:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(sharded)
        opt, ref = optimizer(sharded.parameters(), kind, fmt, rounding), optimizer(whole.parameters(), kind, fmt,
                                                                                   rounding)
        for step in range(steps):
            x, y = batch(step)
            mine = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
            nn.functional.cross_entropy(sharded(x[mine]), y[mine]).backward()
            opt.step()
            opt.zero_grad()
            nn.functional.cross_entropy(whole(x), y).backward()
            ref.step()
            ref.zero_grad()
        diff = torch.cat([(p.detach().full_tensor() - q.detach()).flatten()
                          for p, q in zip(sharded.parameters(), whole.parameters()) if q.ndim == 2])
        rows.append({"optimizer": kind, "state_format": fmt, "state_rounding": rounding,
                     "max_over_lr": diff.abs().max().item() / LR[kind],
                     "rms_over_lr": diff.square().mean().sqrt().item() / LR[kind]})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def _position_keyed(x: torch.Tensor, block_size: int, key: int) -> torch.Tensor:
    """``x`` rounded stochastically onto the 4bit map with draws keyed by ``key`` and each element's
    index (the prototype; 2-D plain ``x``), as the values a 4bit state decodes."""
    from qstate.optim._rounding import position_draws

    q = qstate.quantize(x, "4bit", block_size=block_size)  # its block scales and map
    scale = q.scale.repeat_interleave(block_size, dim=1)[:, :x.shape[1]]
    y = torch.where(scale == 0, torch.zeros_like(x), x / scale)
    c = (torch.searchsorted(q.qmap, y.contiguous(), right=True) - 1).clamp(0, q.qmap.numel() - 2)
    lo, hi = q.qmap[c], q.qmap[c + 1]
    u = (position_draws(key, torch.arange(x.numel()).view(x.shape)).float() + 0.5) / 65536
    return torch.where(u * (hi - lo) < y - lo, hi, lo) * scale


def prototype_rows(steps: int, block_size: int = 128) -> list[dict]:
    """Plain-PyTorch Muon (torch's Newton-Schulz) with 4bit momentum under each rounding, whole
    batches against averaged microbatches; non-matrix parameters take plain SGD."""
    import math

    from torch.optim._muon import _zeropower_via_newtonschulz

    def store(x, rounding, key):
        if rounding == "fp32":
            return x
        if rounding == "position_keyed":
            return _position_keyed(x, block_size, key)
        return qstate.quantize(x, "4bit", block_size=block_size, rounding=rounding).dequantize()

    def run(rounding, microbatches):
        m = model()
        params = list(m.parameters())
        bufs = [torch.zeros_like(p) for p in params]
        for step in range(steps):
            x, y = batch(step)
            grads = []
            for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
                m.zero_grad()
                nn.functional.cross_entropy(m(xs), ys).backward()
                grads.append([p.grad.clone() for p in params])
            with torch.no_grad():
                for i, p in enumerate(params):
                    g = sum(gs[i] for gs in grads) / microbatches if microbatches > 1 else grads[0][i]
                    if p.ndim != 2:
                        p.add_(g, alpha=-LR["adamw"])
                        continue
                    buf = bufs[i].lerp(g, 0.05)
                    update = _zeropower_via_newtonschulz(g.lerp(buf, 0.95), (3.4445, -4.775, 2.0315), 5, 1e-7)
                    bufs[i] = store(buf, rounding, (i * 1_000_003 + step) * 2_654_435_761 % 2**62)
                    p.mul_(1 - LR["muon"] * 0.1)
                    p.add_(update, alpha=-LR["muon"] * math.sqrt(max(1, p.shape[0] / p.shape[1])))
        return [p.detach() for p in params if p.ndim == 2]

    rows = []
    for rounding in ("fp32", "nearest", "stochastic", "position_keyed"):
        diff = torch.cat([(a - b).flatten() for a, b in zip(run(rounding, 1), run(rounding, 3))])
        rows.append({"rounding": rounding, "max_over_lr": diff.abs().max().item() / LR["muon"],
                     "rms_over_lr": diff.square().mean().sqrt().item() / LR["muon"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        run_ranks(body, args.world_size, args.steps, path, backend="gloo")
        with open(path) as f:
            rows = json.load(f)
    base = {r["optimizer"]: r["rms_over_lr"] for r in rows if r["state_format"] == "fp32"}
    nearest4 = {r["optimizer"]: r["rms_over_lr"] for r in rows
                if r["state_format"] == "4bit" and r["state_rounding"] == "nearest"}
    print(f"{args.world_size} ranks vs unsharded, {args.steps} steps; |dp| over the 2-D params, in units of lr")
    print(f"{'optimizer':9} {'format':6} {'rounding':10} {'max/lr':>9} {'rms/lr':>9} {'/fp32':>7} {'/4bit-rn':>8}")
    for r in rows:
        k = r["optimizer"]
        print(f"{k:9} {r['state_format']:6} {str(r['state_rounding']):10} {r['max_over_lr']:9.2e} "
              f"{r['rms_over_lr']:9.2e} {r['rms_over_lr'] / base[k]:7.1f} {r['rms_over_lr'] / nearest4[k]:8.1f}")
    torch.set_num_threads(1)
    prototype = prototype_rows(args.steps)
    nearest = next(r["rms_over_lr"] for r in prototype if r["rounding"] == "nearest")
    print(f"\none process, plain Muon, 4bit momentum: 3 microbatches vs 1 batch, {args.steps} steps")
    print(f"{'rounding':15} {'max/lr':>9} {'rms/lr':>9} {'/nearest':>8}")
    for r in prototype:
        print(f"{r['rounding']:15} {r['max_over_lr']:9.2e} {r['rms_over_lr']:9.2e} {r['rms_over_lr'] / nearest:8.1f}")
    save_json({"command": " ".join(["python"] + sys.argv), "env": environment(), "rows": rows,
               "prototype": prototype}, args.out,
              "muon_float_order.json")


if __name__ == "__main__":
    main()
