"""Optimizer step time and state memory: qstate AdamW (each format, eager/compiled) vs torch AdamW.

Ratios are to torch's fused fp32 AdamW measured in the same run, side by side.
torchao.optim / bitsandbytes are included when importable.

    python benchmarks/bench_step.py --sizes 1M,16M [--repeats 10] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import qstate  # noqa: E402
from qstate.optim import AdamW  # noqa: E402


def _size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def _params(n: int) -> list[torch.nn.Parameter]:
    # a square-ish weight (rows of 1024) plus a bias-like vector
    rows = max(1, n // 1024)
    return [torch.nn.Parameter(torch.randn(rows, 1024)), torch.nn.Parameter(torch.randn(1024))]


def _state_bytes(opt) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, qstate.QuantizedState):
                total += v.storage_nbytes()
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                total += v.numel() * v.element_size()
            elif hasattr(v, "numel") and hasattr(v, "element_size"):
                total += v.numel() * v.element_size()
    return total


def _candidates():
    c = {
        "torch fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "torch foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    }
    for fmt in ("8bit", "4bit", "fp8", "bf16", "fp32"):
        for compile in (True, False):
            c[f"qstate {fmt} {'compiled' if compile else 'eager'}"] = (
                lambda ps, fmt=fmt, compile=compile: AdamW(ps, lr=1e-3, state_format=fmt, compile=compile))
    try:
        from torchao.optim import AdamW8bit  # type: ignore

        c["torchao AdamW8bit"] = lambda ps: AdamW8bit(ps, lr=1e-3)
    except Exception:
        pass
    try:
        import bitsandbytes as bnb  # type: ignore

        c["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)
    except Exception:
        pass
    return c


def bench(n: int, repeats: int, only: list[str] | None) -> dict:
    rows = {}
    for name, make in _candidates().items():
        if only and not any(o in name for o in only):
            continue
        torch.manual_seed(0)
        ps = _params(n)
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = make(ps)
        t0 = time.perf_counter()
        opt.step()  # states + compile
        first = time.perf_counter() - t0
        opt.step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        rows[name] = {"median_ms": 1e3 * statistics.median(times), "first_step_s": first,
                      "state_bytes": _state_bytes(opt), "numel": sum(p.numel() for p in ps)}
        print(f"  {name:28s} {rows[name]['median_ms']:9.2f} ms  state {rows[name]['state_bytes'] / 2**20:8.1f} MiB",
              flush=True)
    base = rows.get("torch fused")
    for r in rows.values():
        r["time_vs_fused"] = r["median_ms"] / base["median_ms"] if base else None
        r["memory_vs_fused"] = r["state_bytes"] / base["state_bytes"] if base else None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M,64M", help="parameter counts, e.g. 1M,16M,64M")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--only", default="", help="comma list of substrings of candidate names")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    only = [o for o in args.only.split(",") if o]
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "sizes": {}}
    for s in args.sizes.split(","):
        n = _size(s)
        print(f"== {s} parameters ({n})", flush=True)
        results["sizes"][s] = bench(n, args.repeats, only)
    print("\nratios to torch fused fp32 AdamW (time / state memory)")
    names = sorted({k for r in results["sizes"].values() for k in r})
    print(f"{'optimizer':28s} " + " ".join(f"{s:>16s}" for s in results["sizes"]))
    for name in names:
        cells = []
        for r in results["sizes"].values():
            x = r.get(name)
            cells.append(f"{x['time_vs_fused']:6.2f}x / {x['memory_vs_fused']:4.2f}" if x else " " * 16)
        print(f"{name:28s} " + " ".join(f"{c:>16s}" for c in cells))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_step.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nsaved {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 5))
        sizes = list(results["sizes"])
        for name in names:
            ys = [results["sizes"][s].get(name, {}).get("time_vs_fused") for s in sizes]
            ax.plot(sizes, ys, marker="o", label=name)
        ax.axhline(1.5, color="k", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("step time / torch fused AdamW")
        ax.legend(fontsize=7)
        fig.savefig(os.path.join(args.out, "bench_step.png"), dpi=120, bbox_inches="tight")
    except Exception:
        pass


if __name__ == "__main__":
    main()
