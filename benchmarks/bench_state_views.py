"""Reads and writes through views of a quantized state (``QuantizedStateView``), as Shampoo/SOAP/Muon-style
code writes them, against the same ops on a plain fp32 tensor.

One state of ``--shape`` per format; each candidate runs:

* ``t() @ x``: a transposed read into a matrix product (``x``: 64 columns);
* ``[:, :k].mul_``: an in-place write into the first ``k`` columns of every row (``--cols``);
* ``.mul_``: the same write into the whole state (the cost of one requantize of every block).

Printed: each time as a ratio to the same op on a plain fp32 tensor of the shape. Timing: interleaved
rounds, medians (``_common.py``).

    python benchmarks/bench_state_views.py [--shape 4096x4096] [--cols 128] [--formats 8bit,4bit]
                                           [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse

import torch

from _common import parse_list, print_ratios, time_interleaved

import qstate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--cols", type=int, default=128)
    ap.add_argument("--formats", default="8bit,4bit")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = tuple(int(n) for n in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    plain = torch.randn(shape, generator=gen)
    x = torch.randn(shape[0], 64, generator=gen)
    k = args.cols
    for what, op in {"t() @ x": lambda t: t.t() @ x,
                     f"[:, :{k}].mul_": lambda t: t[:, :k].mul_(1.0001),
                     ".mul_": lambda t: t.mul_(1.0001)}.items():
        steps = {"fp32 tensor": lambda op=op: op(plain)}
        for fmt in parse_list(args.formats):
            state = qstate.quantize(plain, fmt)
            steps[f"{fmt} state"] = lambda op=op, state=state: op(state)
        times = time_interleaved(steps, args.repeats)
        print_ratios(times, "fp32 tensor", f"\n{what}: shape {shape}, {torch.get_num_threads()} thread(s), "
                                            f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
