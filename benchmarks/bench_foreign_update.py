"""Adam's moment update written op by op on quantized states, as another optimizer library writes it.

One parameter of ``--shape`` and its gradient; each candidate runs Adam's
moment update (``m.lerp_(g, 0.1)``, ``v.mul_(0.999).addcmul_(g, g, value=0.001)``)
and the parameter update ``p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)``:

* ``torch fused AdamW``: torch's whole fused fp32 step (the reference, 1.00);
* ``op by op, fp32 states``: the ops on plain fp32 states;
* ``op by op, <fmt> states``: the ops straight on quantized states (each
  in-place op decodes and re-encodes its state);
* ``update_states, <fmt> states``: the same ops inside
  ``qstate.update_states([m, v])`` (one decode and one encode per state);
* ``Adafactor, fp32 / <fmt> first moment``: Adafactor's step (factored second
  moment as row and column means, plain; its first moment ``m.lerp_(u, 0.1)``)
  written op by op, the first moment plain or quantized (as in
  ``docs/extending.md``, without ``update_states``).

Also printed: the error of each quantized candidate's moments against the fp32
op-by-op moments after ``--steps`` steps (one requantize per step against one
per op). Timing: interleaved rounds, medians (``_common.py``).

    python benchmarks/bench_foreign_update.py [--shape 4096x4096] [--formats 8bit,4bit] [--repeats 7]
                                              [--threads N]
"""

from __future__ import annotations

import argparse

import torch

from _common import parse_list, print_ratios, time_interleaved

import qstate


def moments(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
    m.lerp_(g, 0.1)
    v.mul_(0.999).addcmul_(g, g, value=0.001)


def param_update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)


def adafactor_step(p: torch.Tensor, g: torch.Tensor, row: torch.Tensor, col: torch.Tensor, m: torch.Tensor) -> None:
    sq = g.square() + 1e-30
    row.lerp_(sq.mean(dim=1), 1e-3)
    col.lerp_(sq.mean(dim=0), 1e-3)
    update = g * (row.unsqueeze(1) * col.unsqueeze(0) / row.mean()).rsqrt()
    m.lerp_(update, 0.1)
    p.add_(m, alpha=-1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--formats", default="8bit,4bit")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="steps before the error is measured")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = tuple(int(x) for x in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(shape, generator=gen)

    fused_p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    fused_p.grad = g.clone()
    fused = torch.optim.AdamW([fused_p], lr=1e-3, fused=True)

    p32, m32, v32 = torch.randn(shape, generator=gen), torch.zeros(shape), torch.zeros(shape)

    def plain_step():
        moments(m32, v32, g)
        param_update(p32, m32, v32)

    steps = {"torch fused AdamW": fused.step, "op by op, fp32 states": plain_step}
    states = {}
    for fmt in parse_list(args.formats):
        for how in ("op by op", "update_states"):
            p = torch.randn(shape, generator=gen)
            m, v = qstate.zeros_like(p, fmt), qstate.zeros_like(p, fmt, signed=False)
            states[f"{how}, {fmt} states"] = (m, v)
            if how == "op by op":
                def step(p=p, m=m, v=v):
                    moments(m, v, g)
                    param_update(p, m, v)
            else:
                def step(p=p, m=m, v=v):
                    with qstate.update_states([m, v]) as (mw, vw):
                        moments(mw, vw, g)
                    param_update(p, mw, vw)
            steps[f"{how}, {fmt} states"] = step

    for fmt in ["fp32"] + parse_list(args.formats):
        p = torch.randn(shape, generator=gen)
        row, col = torch.zeros(shape[0]), torch.zeros(shape[1])
        m = torch.zeros(shape) if fmt == "fp32" else qstate.zeros_like(p, fmt)
        steps[f"Adafactor, {fmt} first moment"] = lambda p=p, row=row, col=col, m=m: adafactor_step(p, g, row, col, m)

    # the error after --steps steps, against fp32 op-by-op moments from zero
    ref_m, ref_v = torch.zeros(shape), torch.zeros(shape)
    for _ in range(args.steps):
        moments(ref_m, ref_v, g)
    for name, (m, v) in states.items():
        for _ in range(args.steps):
            if name.startswith("op by op"):
                moments(m, v, g)
            else:
                with qstate.update_states([m, v]) as (mw, vw):
                    moments(mw, vw, g)
        err_m = (m.dequantize() - ref_m).abs().max().item() / ref_m.abs().max().item()
        err_v = (v.dequantize() - ref_v).abs().max().item() / ref_v.abs().max().item()
        print(f"{name:32s} after {args.steps} steps: max |error| / max |value|: m {err_m:.2e}, v {err_v:.2e}")

    times = time_interleaved(steps, args.repeats)
    print_ratios(times, "torch fused AdamW",
                 f"\nshape {shape}, {torch.get_num_threads()} thread(s), torch {torch.__version__}")

if __name__ == "__main__":
    main()
