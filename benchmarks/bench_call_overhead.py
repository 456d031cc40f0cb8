"""Per-parameter cost of a step with many parameters: prepared calls against the full path, and torch fused.

A model of ``--params`` weights of one ``--shape`` (rows a whole number of
blocks, or not: ``--shape 64x640`` pads each row in the inductor kernel's
block space) steps with:

* ``torch fused``: torch's fused fp32 AdamW (one multi-tensor kernel);
* ``qstate <fmt> compiled``: qstate AdamW, ``compile=True``; after the first
  step every parameter's update is a prepared call (``qstate/optim/_prepared.py``);
* ``qstate <fmt> compiled, full path``: the same, with the prepared calls
  forgotten before each step (each update re-derives its kernel spec, re-checks its
  states and rebuilds the kernel's arguments: what every step did before a
  kernel prepared its calls);
* ``qstate <fmt> compiled, one call each`` (inductor kernel only): prepared
  calls without batches (``_kernels._BATCH_LIMITS`` emptied around the step):
  what the calls of small parameters cost before they ran in batches.

``--bf16-sr``: qstate's weights in bfloat16 with ``bf16_stochastic_round=True``
(torch fused stays on float32 weights: the step-time targets' reference).

On CPU ``--kernel c`` (default) steps the C kernel and ``--kernel inductor``
the compiled inductor kernel (``cpu_kernel_enabled(False)``); with
``--device cuda`` the kernel is inductor's Triton kernel, and each timed step
ends with ``torch.cuda.synchronize()``. Timing: interleaved rounds, medians
(``_common.py``). The ``us/param over fused`` column is
``(step - fused step) / params``: the per-parameter cost beyond torch's.

    python benchmarks/bench_call_overhead.py [--device cpu|cuda] [--kernel c|inductor] [--params 64]
                                             [--shape 1024x1024] [--formats 8bit] [--bf16-sr] [--repeats 15]
                                             [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from _common import RESULTS_DIR, environment, median_ms, parse_list, save_json, time_interleaved
from qstate.optim import AdamW, cpu_kernel_enabled
from qstate.optim._engine import inductor as _kernels
from qstate.optim._engine.prepared import clear_prepared_calls

BASELINE = "torch fused"


def _model(n: int, shape: tuple[int, ...], device: str, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device, dtype)) for _ in range(n)]
    for p in ps:
        p.grad = (torch.randn(shape, generator=gen) * 1e-2).to(device, dtype)
    return ps


@contextlib.contextmanager
def _one_call_each():
    """Prepared inductor calls run one by one, not in batches, within the block."""
    limits = _kernels._BATCH_LIMITS
    _kernels._BATCH_LIMITS = {}
    try:
        yield
    finally:
        _kernels._BATCH_LIMITS = limits


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--kernel", default="c", choices=["c", "inductor"], help="CPU only: the fused kernel")
    ap.add_argument("--params", type=int, default=64)
    ap.add_argument("--shape", default="1024x1024", help="each weight's shape, e.g. 1024x1024 or 64x640")
    ap.add_argument("--formats", default="8bit")
    ap.add_argument("--bf16-sr", action="store_true", help="qstate's weights in bfloat16, stochastically rounded")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.lower().split("x"))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    kernel = "inductor" if args.device == "cuda" else args.kernel
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    opts = {BASELINE: torch.optim.AdamW(_model(args.params, shape, args.device), lr=1e-3, fused=True)}
    dtype = torch.bfloat16 if args.bf16_sr else torch.float32
    variants = ["", ", full path"] + ([", one call each"] if kernel == "inductor" else [])
    for fmt in parse_list(args.formats):
        for variant in variants:
            opts[f"qstate {fmt} compiled{variant}"] = AdamW(
                _model(args.params, shape, args.device, dtype), lr=1e-3, state_format=fmt, compile=True,
                bf16_stochastic_round=args.bf16_sr)

    def stepper(name: str, opt: torch.optim.Optimizer):
        def step() -> None:
            if name.endswith("full path"):
                clear_prepared_calls([p for group in opt.param_groups for p in group["params"]])
            with _one_call_each() if name.endswith("one call each") else contextlib.nullcontext():
                opt.step()
            sync()
        return step

    with cpu_kernel_enabled(kernel == "c") if args.device == "cpu" else contextlib.nullcontext():
        steps = {name: stepper(name, opt) for name, opt in opts.items()}
        for step in steps.values():  # states, compilation, the prepared calls
            step()
            step()
        times = time_interleaved(steps, args.repeats)
    fused = median_ms(times[BASELINE])
    print(f"{args.params} parameters of {list(shape)}{' bf16, stochastic rounding' if args.bf16_sr else ''} "
          f"on {args.device} ({kernel} kernel); "
          f"ratios to torch fused fp32 AdamW")
    print(f"{'optimizer':34s} {'step ms':>8s} {'x fused':>8s} {'us/param over fused':>20s}")
    rows = {}
    for name, ts in times.items():
        ms = median_ms(ts)
        over = (ms - fused) * 1e3 / args.params
        rows[name] = {"step_ms": ms, "x_fused": ms / fused, "us_per_param_over_fused": over}
        print(f"{name:34s} {ms:8.3f} {ms / fused:8.2f} {over:20.1f}")
    save_json({"command": " ".join(sys.argv), "env": environment(), "device": args.device, "kernel": kernel,
               "params": args.params, "shape": list(shape), "bf16_sr": args.bf16_sr, "results": rows}, args.out, "bench_call_overhead.json")


if __name__ == "__main__":
    main(sys.argv[1:])
