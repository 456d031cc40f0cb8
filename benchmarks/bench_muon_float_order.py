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

Stochastic rounding draws by each element's index under a key per parameter
and step (``qstate/formats/_rounding.py``), so a small change of a value
changes its code with a probability proportional to the change, as with
round-to-nearest. Writes JSON.

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
    if kind == "muon":  # its rounding stream's seed is 0
        return qstate.optim.Muon(params, lr=LR[kind], **policy)
    return qstate.optim.AdamW(params, lr=LR[kind], seed=0, **policy)  # both runs: one rounding stream


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
    save_json({"command": " ".join(["python"] + sys.argv), "env": environment(), "rows": rows}, args.out,
              "muon_float_order.json")


if __name__ == "__main__":
    main()
