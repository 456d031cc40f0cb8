"""Writes into and reads of a quantized state outside the fused step, against torch's fused AdamW step.

One ``--shape`` tensor of values (16.7M elements by default); for each format, side by side in one run:

* ``torch fused AdamW``: torch's whole fused fp32 step over the same number of elements (1.00);
* ``copy_``: ``state.copy_(values)``, the values encoded into an existing state;
* ``quantize``: ``qstate.quantize(values, fmt)``, a new state;
* ``dequantize``: ``state.dequantize()``, the values read back;
* ``lerp_``: ``state.lerp_(values, 0.1)``, an in-place op on the state (decode, op, encode).

Each is also timed with the C kernel's encode switched off
(``qstate.optim.cpu_kernel_enabled(False)``: the formats' torch encode), the path every write took
before the encode was registered. Timing: interleaved rounds, medians (``_common.py``).

``--moments`` times instead an Adam-like moment update written by hand on two states of each format,
``m.lerp_(g, 0.1); v.mul_(0.999).add_(g * g, alpha=0.001)`` (``v`` unsigned), eager and under
``torch.compile(fullgraph=True)`` (inductor), as a user's compiled optimizer step runs it. (``addcmul_``
on a state does not compile: dynamo rewrites it into ``prims.fma``, which the op table does not take.)

    python benchmarks/bench_state_writes.py [--shape 4096x4096] [--formats 8bit,4bit,fp8] [--repeats 5]
                                            [--threads N] [--moments]
"""

from __future__ import annotations

import argparse

import torch

from _common import parse_list, print_ratios, time_interleaved

import qstate
from qstate.optim import cpu_kernel_enabled


def moments(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
    m.lerp_(g, 0.1)
    v.mul_(0.999).add_(g * g, alpha=0.001)


def moment_steps(values: torch.Tensor, formats: list[str]) -> dict:
    """Per format: :func:`moments` eager and compiled (compiled once here, before the timing)."""
    steps = {}
    compiled = torch.compile(moments, fullgraph=True)
    for fmt in formats:
        m = qstate.quantize(values, fmt)
        v = qstate.quantize(values.abs(), fmt, signed=False)
        compiled(m, v, values)
        steps[f"{fmt} moments, eager"] = lambda m=m, v=v: moments(m, v, values)
        steps[f"{fmt} moments, compiled"] = lambda m=m, v=v: compiled(m, v, values)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--formats", default="8bit,4bit,fp8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--moments", action="store_true", help="time a moment update, eager and compiled, instead")
    ap.add_argument("--no-torch-encode", action="store_true", help="skip the runs with the C encode switched off")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = tuple(int(x) for x in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(shape, generator=gen)

    fused_p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    fused_p.grad = values.clone()
    fused = torch.optim.AdamW([fused_p], lr=1e-3, fused=True)

    steps = {"torch fused AdamW": fused.step}
    if args.moments:
        steps.update(moment_steps(values, parse_list(args.formats)))
    for fmt in parse_list(args.formats) if not args.moments else ():
        state = qstate.quantize(values, fmt)
        ops = {
            "copy_": lambda s=state: s.copy_(values),
            "quantize": lambda fmt=fmt: qstate.quantize(values, fmt),
            "dequantize": lambda s=state: s.dequantize(),
            "lerp_": lambda s=state: s.lerp_(values, 0.1),
        }
        for name, op in ops.items():
            steps[f"{fmt} {name}"] = op
            if not args.no_torch_encode and name != "dequantize":
                def torch_encode(op=op):
                    with cpu_kernel_enabled(False):
                        op()
                steps[f"{fmt} {name}, torch encode"] = torch_encode

    times = time_interleaved(steps, args.repeats)
    print_ratios(times, "torch fused AdamW",
                 f"shape {shape}, {torch.get_num_threads()} thread(s), torch {torch.__version__}")

if __name__ == "__main__":
    main()
