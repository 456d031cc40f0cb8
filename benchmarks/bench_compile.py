"""First-step time and number of compiled graphs of qstate AdamW on a model with many parameter shapes.

    python benchmarks/bench_compile.py [--formats 8bit,4bit,fp8]

Every kernel kind (optimizer rule, flags, parameter dtype, state formats) is
one graph whatever the shapes; the model below has 9 distinct shapes
(2-D, 1-D, 4-D conv, uneven rows and blocks).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qstate.optim import AdamW, kernel_kinds  # noqa: E402


def model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 24, 5), torch.nn.Flatten(), torch.nn.Linear(24 * 12 * 12, 300),
        torch.nn.Linear(300, 513), torch.nn.LayerNorm(513), torch.nn.Linear(513, 77), torch.nn.Linear(77, 10),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="8bit,4bit,fp8")
    ap.add_argument("--min-quantize-numel", type=int, default=4096)
    args = ap.parse_args()
    for fmt in args.formats.split(","):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = model()
        shapes = sorted({tuple(p.shape) for p in m.parameters()})
        opt = AdamW(m.parameters(), state_format=fmt, min_quantize_numel=args.min_quantize_numel)
        x = torch.randn(8, 3, 16, 16)
        m(x).sum().backward()
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        opt.step()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.step()
        second = time.perf_counter() - t0
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        print(f"{fmt}: {len(shapes)} distinct shapes, {len(list(m.parameters()))} params -> {graphs} compiled graphs; "
              f"first step {first:.1f} s, second {1e3 * second:.1f} ms")
    print("kernel kinds:", *kernel_kinds(), sep="\n  ")


if __name__ == "__main__":
    main()
