"""Scaled vs unscaled quantized AdamW step (CPU), measured side by side in one run.

* ``unscaled``: ``opt.step()`` on plain gradients (one pass over the gradient);
* ``scaler.step (fused)``: ``torch.amp.GradScaler.step`` with qstate's fused
  protocol: the scaler's read-only inf/NaN check, then the update unscales as it
  reads (two reads of the gradient, no writes);
* ``unscale_ + step``: ``scaler.unscale_`` first (as before clipping): the
  check-and-unscale pass rewrites the gradient, then the update reads it again.

With ``--skip-nonfinite``, also (no scaler):

* ``skip_nonfinite step``: ``opt.step()`` of an optimizer with
  ``skip_nonfinite=True``, which checks the gradient first
  (``qstate.amp.found_non_finite``: one pass, no collective here);
* ``check alone``: that check by itself.

    python benchmarks/bench_grad_scaling.py [--numel 16M] [--format 8bit] [--repeats 15] [--skip-nonfinite]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import qstate.amp
import qstate.optim


def _numel(s: str) -> int:
    s = s.strip().upper()
    return int(float(s[:-1]) * {"K": 1 << 10, "M": 1 << 20}[s[-1]]) if s[-1] in "KM" else int(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", default="16M")
    ap.add_argument("--format", default="8bit")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--skip-nonfinite", action="store_true",
                    help="also time a step with skip_nonfinite=True and its gradient check alone")
    args = ap.parse_args()
    n = _numel(args.numel)
    p = torch.nn.Parameter(torch.randn(max(1, n // 1024), 1024))
    opt = qstate.optim.AdamW([p], lr=1e-3, state_format=args.format)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=10**9)
    grad = torch.randn_like(p)

    def scaled_grad() -> None:
        scaler.scale(torch.ones(()))  # as scaler.scale(loss).backward() does
        p.grad = grad * scaler.get_scale()

    def unscale_then_step() -> None:
        scaler.unscale_(opt)
        scaler.step(opt)

    cases = {  # name: (untimed set-up of the gradient, timed step)
        "unscaled": (lambda: setattr(p, "grad", grad.clone()), opt.step),
        "scaler.step (fused)": (scaled_grad, lambda: scaler.step(opt)),
        "unscale_ + step": (scaled_grad, unscale_then_step),
    }
    if args.skip_nonfinite:
        checking = qstate.optim.AdamW([p], lr=1e-3, state_format=args.format, skip_nonfinite=True)
        checking.state = opt.state  # the same states: the step's cost, not a first step's
        cases["skip_nonfinite step"] = (lambda: setattr(p, "grad", grad.clone()), checking.step)
        cases["check alone"] = (lambda: setattr(p, "grad", grad.clone()),
                                lambda: qstate.amp.found_non_finite(checking).item())
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats + 1):  # interleaved, so drift hits every case alike; first = warm-up
        for name, (prepare, run) in cases.items():
            prepare()
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
            if name in ("scaler.step (fused)", "unscale_ + step"):
                scaler.update()
    times = {k: v[1:] for k, v in times.items()}
    base = statistics.median(times["unscaled"])
    print(f"qstate AdamW {args.format}, {n:,} params, {torch.get_num_threads()} threads")
    for name, ts in times.items():
        print(f"  {name:22s} {statistics.median(ts) * 1e3:8.1f} ms  {statistics.median(ts) / base:5.2f}x")


if __name__ == "__main__":
    main()
