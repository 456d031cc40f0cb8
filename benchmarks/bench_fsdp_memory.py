"""Optimizer-state bytes per parameter under FSDP2, world sizes 2 and 3.

Adam-style states (``exp_avg`` signed, ``exp_avg_sq`` unsigned) are created
with :func:`qstate.state_like` (default policy: quantize ``ndim >= 2`` tensors
of >= 4096 elements, else fp32) for a model whose layers have first dims not
divisible by the world size. Prints a table and writes JSON.

    python benchmarks/bench_fsdp_memory.py [--out benchmarks/results/fsdp_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

import qstate
from qstate.launch import run_ranks

FORMATS = ("fp32", "8bit", "4bit", "fp8")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(5003, 257), nn.Linear(257, 1025), nn.GELU(), nn.Linear(1025, 257),
                         nn.LayerNorm(257), nn.Linear(257, 65))


def body(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    m = model()
    for layer in m:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(m)
    params = list(m.parameters())
    total_params = sum(p.numel() for p in params)
    row = {}
    for fmt in FORMATS:
        nbytes = 0
        for p in params:
            for signed in (True, False):
                if fmt == "fp32":
                    s = torch.zeros_like(p)
                else:
                    s = qstate.state_like(p, fmt, signed=signed)
                nbytes += qstate.distributed.local_nbytes(s)
        per_rank = torch.tensor([nbytes], dtype=torch.float64)
        gathered = [torch.zeros_like(per_rank) for _ in range(world_size)]
        dist.all_gather(gathered, per_rank)
        all_bytes = [int(t.item()) for t in gathered]
        row[fmt] = {"bytes_per_rank": all_bytes, "bytes_per_param": sum(all_bytes) / total_params}
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world_size": world_size, "params": total_params, "formats": row}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/fsdp_memory.json")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for ws in (2, 3):
            path = os.path.join(tmp, f"ws{ws}.json")
            run_ranks(body, ws, path)
            with open(path) as f:
                results.append(json.load(f))
    print(f"model: {results[0]['params']:,} parameters (layers 5003x257, 1025x257, 257x1025, 65x257, 1-D biases)")
    print(f"{'world':>5} {'format':>6} {'state bytes/param':>18} {'vs fp32':>8}  bytes per rank")
    for r in results:
        base = r["formats"]["fp32"]["bytes_per_param"]
        for fmt in FORMATS:
            f = r["formats"][fmt]
            print(f"{r['world_size']:>5} {fmt:>6} {f['bytes_per_param']:>18.4f} {f['bytes_per_param'] / base:>8.3f}  "
                  f"{f['bytes_per_rank']}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
