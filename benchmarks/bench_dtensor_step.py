"""qstate AdamW step on DTensor-sharded parameters vs the same step on local tensors, and its collectives.

Each rank (spawned by ``qstate.launch.run_ranks``: gloo, one thread) holds
``Shard(0)`` DTensor parameters (a ``[n / 1024 + 1, 1024]`` weight, uneven
over 2 ranks, and a ``[1024]`` bias) and plain copies of its local shards.
Four optimizers; the two compiled ones timed interleaved (see ``_common.py``), each
round after a barrier so that every rank times the same one at once, then the eager ones:

* ``dtensor``: ``AdamW(state_format=fmt)`` (default ``compile=True``) on the DTensors;
* ``local compiled``: the same on the local shards;
* ``local eager``: ``compile=False`` on the local shards (the op-by-op math);
* ``dtensor eager``: ``compile=False`` on the DTensors (op by op through DTensor's dispatch).

``--bf16-sr``: bfloat16 parameters with ``bf16_stochastic_round=True`` (before 2026-12-04 the
``dtensor`` step ran these op by op, as ``dtensor eager`` does; now the shards' C kernel).

Reported per world size, size and format: the slowest rank's median step of
each, the ratios, and the collectives one DTensor step issues (counted with
``torch.distributed.tensor.debug.CommDebugMode`` on the first step, which
creates the states, and on the second).

    python benchmarks/bench_dtensor_step.py [--world-sizes 1,2] [--sizes 1M] [--formats 8bit] [--bf16-sr] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from _common import (RESULTS_DIR, environment, median_ms, parse_list, parse_size, save_json, target_line,
                     time_interleaved)
from qstate.launch import run_ranks
from qstate.optim import AdamW

CANDIDATES = ("dtensor", "local compiled", "local eager", "dtensor eager")


def _collectives(step) -> dict[str, int]:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        step()
    return {str(op): int(c) for op, c in comm.get_comm_counts().items()}


def bench_rank(mesh, n: int, fmt: str, repeats: int, bf16_sr: bool = False) -> dict:
    """This rank's medians (ms) per candidate and the DTensor optimizer's collectives per step."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)  # the same full tensors on every rank
    dtype = torch.bfloat16 if bf16_sr else torch.float32
    full = [torch.randn(n // 1024 + 1, 1024).to(dtype), torch.randn(1024).to(dtype)]
    dt = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
    dt_eager = [torch.nn.Parameter(p.detach().clone()) for p in dt]
    local = [torch.nn.Parameter(p.to_local().clone()) for p in dt]
    for d, e, p in zip(dt, dt_eager, local):
        g = torch.randn(d.shape).to(dtype)
        d.grad = distribute_tensor(g, mesh, [Shard(0)])
        e.grad = d.grad.clone()
        p.grad = d.grad.to_local().clone()
    kw = {"lr": 1e-3, "state_format": fmt, "bf16_stochastic_round": bf16_sr}
    opts = {"dtensor": AdamW(dt, **kw), "local compiled": AdamW(local, compile=True, **kw),
            "local eager": AdamW(local, compile=False, **kw), "dtensor eager": AdamW(dt_eager, compile=False, **kw)}
    comms = {"first_step": _collectives(opts["dtensor"].step), "later_step": _collectives(opts["dtensor"].step)}
    for name in CANDIDATES[1:]:
        opts[name].step()  # states, compilation
    # the two compiled steps interleaved, every rank on the same one at a time; the eager ones (about
    # 50x longer, whose temporaries flush the caches) on their own afterwards
    fast = ("dtensor", "local compiled")
    times = time_interleaved({name: opts[name].step for name in fast}, repeats, sync=dist.barrier)
    for name in ("local eager", "dtensor eager"):
        times.update(time_interleaved({name: opts[name].step}, max(1, repeats // 5), sync=dist.barrier))
    return {"median_ms": {name: median_ms(t) for name, t in times.items()}, "collectives": comms,
            "local_numel": sum(p.numel() for p in local)}


def body(rank: int, world_size: int, sizes: list[str], formats: list[str], repeats: int, path: str,
         bf16_sr: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    rows = []
    for label in sizes:
        for fmt in formats:
            mine = bench_rank(mesh, parse_size(label), fmt, repeats, bf16_sr)
            every = [None] * world_size
            dist.all_gather_object(every, mine)
            slowest = {c: max(r["median_ms"][c] for r in every) for c in CANDIDATES}
            rows.append({"world_size": world_size, "size": label, "format": fmt, "median_ms": slowest,
                         "per_rank": every,
                         "dtensor_vs_local_compiled": slowest["dtensor"] / slowest["local compiled"],
                         "dtensor_vs_local_eager": slowest["dtensor"] / slowest["local eager"],
                         "dtensor_vs_dtensor_eager": slowest["dtensor"] / slowest["dtensor eager"],
                         "collectives": {k: max(sum(r["collectives"][k].values()) for r in every)
                                         for k in ("first_step", "later_step")}})
    if rank == 0:
        with open(path, "w") as f:
            json.dump(rows, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--sizes", default="1M", help="parameter counts (K/M/G = 2**10/20/30)")
    ap.add_argument("--formats", default="8bit")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per candidate (median reported)")
    ap.add_argument("--bf16-sr", action="store_true", help="bfloat16 params, bf16_stochastic_round=True")
    ap.add_argument("--out", default=RESULTS_DIR, help="directory for bench_dtensor_step.json")
    args = ap.parse_args()
    sizes, formats = parse_list(args.sizes), parse_list(args.formats)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ws in (int(w) for w in parse_list(args.world_sizes)):
            path = os.path.join(tmp, f"ws{ws}.json")
            run_ranks(body, ws, sizes, formats, args.repeats, path, args.bf16_sr)
            with open(path) as f:
                rows += json.load(f)
    print("median step ms (slowest rank); dtensor = AdamW on Shard(0) DTensors, local = on the local shards"
          + (" (bf16 params, bf16_stochastic_round)" if args.bf16_sr else ""))
    print(f"{'world':>5s} {'size':>5s} {'format':>6s} {'dtensor':>9s} {'local comp.':>11s} {'local eager':>11s} "
          f"{'dt. eager':>10s} {'/comp.':>7s} {'/eager':>7s} {'/dt.eager':>9s} {'collectives 1st/2nd step':>24s}")
    targets = []
    for r in rows:
        m = r["median_ms"]
        print(f"{r['world_size']:5d} {r['size']:>5s} {r['format']:>6s} {m['dtensor']:9.2f} {m['local compiled']:11.2f} "
              f"{m['local eager']:11.2f} {m['dtensor eager']:10.2f} {r['dtensor_vs_local_compiled']:7.2f} "
              f"{r['dtensor_vs_local_eager']:7.2f} {r['dtensor_vs_dtensor_eager']:9.3f} "
              f"{r['collectives']['first_step']:>20d} / {r['collectives']['later_step']}")
        where = f"world {r['world_size']}, {r['size']}, {r['format']}"
        targets.append(target_line(f"{where}: dtensor / local compiled step", r["dtensor_vs_local_compiled"], 1.1))
        targets.append(target_line(f"{where}: collectives in a dtensor step (2nd)", r["collectives"]["later_step"], 0))
    print("targets:", *targets, sep="\n  ")
    save_json({"env": environment(), "command": " ".join(["python"] + sys.argv), "repeats": args.repeats,
               "bf16_sr": args.bf16_sr,
               "rows": rows, "targets": targets}, args.out,
              "bench_dtensor_step_bf16_sr.json" if args.bf16_sr else "bench_dtensor_step.json")


if __name__ == "__main__":
    main()
