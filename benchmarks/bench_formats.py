"""Bytes per element and round-trip error of each format (default block sizes).

    python benchmarks/bench_formats.py
"""

from __future__ import annotations

import torch

import qstate


def main() -> None:
    g = torch.Generator().manual_seed(0)
    print(f"{'format':>6} {'signed':>8} {'numel':>9} {'bytes/elem':>10} {'rel. RMS err':>12} {'max err/absmax':>14}")
    for fmt in sorted(qstate.formats.FORMATS):
        for signed in (True, False):
            for n in (1 << 20, (1 << 20) + 1):
                x = torch.randn(n, generator=g)
                x = x if signed else x.square()  # a second moment is a square
                q = qstate.quantize(x, fmt, signed=signed)
                err = q.dequantize() - x
                rel_rms = (err.square().mean() / x.square().mean()).sqrt().item()
                print(f"{fmt:>6} {str(signed):>8} {n:>9} {q.storage_nbytes() / n:>10.4f} {rel_rms:>12.3e} "
                      f"{(err.abs().max() / x.abs().max()).item():>14.3e}")


if __name__ == "__main__":
    main()
