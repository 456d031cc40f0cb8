"""``python -m qstate.demo``: the main job.

Placeholder until the optimizers land: prints what is installed and
quantizes one tensor in every format.
"""

from __future__ import annotations

import torch

import qstate


def main() -> None:
    print(f"qstate {qstate.__version__}, torch {torch.__version__}")
    x = torch.randn(1000, 1001)
    print(f"{'format':8} {'bytes/elem':>10} {'max abs err':>12}")
    for fmt in sorted(qstate.formats.FORMATS):
        q = qstate.quantize(x, fmt)
        err = (q.dequantize() - x).abs().max().item()
        print(f"{fmt:8} {q.storage_nbytes() / x.numel():10.4f} {err:12.4g}")


if __name__ == "__main__":
    main()
