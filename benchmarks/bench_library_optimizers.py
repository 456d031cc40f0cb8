"""Other libraries' optimizers stepping on swapped-in 8bit states, against torch's fused AdamW.

One ``--shape`` parameter; for each optimizer, side by side in one run: its step with its own fp32
states, and with every state quantized to 8bit after its first step (``qstate.quantize``; second
moments, whose names hold ``sq``, unsigned), stepping through qstate's ops on the states. Ratios to
``torch.optim.AdamW(fused=True)``. Needs ``pip install -e ".[integrations]"`` (heavyball,
pytorch-optimizer). Timing: interleaved rounds, medians (``_common.py``).

heavyball compiles its step by default (``torch.compile``, where the states' encode and decode are
the ops ``qstate::encode_into_`` and ``qstate::decode``, whose CPU kernels are the C kernel's);
``--heavyball-eager`` sets ``heavyball.utils.compile_mode = None``.

    python benchmarks/bench_library_optimizers.py [--shape 2048x2048] [--repeats 5] [--threads N]
                                                  [--heavyball-eager] [--optimizers heavyball,Adan]
"""

from __future__ import annotations

import argparse

import heavyball
import pytorch_optimizer
import torch

from _common import parse_list, print_ratios, time_interleaved

import qstate

OPTIMIZERS = {
    "torch AdamW, for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "torch AdamW, foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "heavyball AdamW": lambda ps: heavyball.AdamW(ps, lr=1e-3),
    "pytorch_optimizer Adan": lambda ps: pytorch_optimizer.Adan(ps, lr=1e-3),
}


def quantize_states(state: dict) -> None:
    for key, value in list(state.items()):
        if isinstance(value, dict):
            quantize_states(value)
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() >= 64:
            state[key] = qstate.quantize(value, "8bit", signed="sq" not in str(key))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2048x2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--optimizers", default=None,
                    help="comma-separated parts of the names of the optimizers to run (default: all)")
    ap.add_argument("--heavyball-eager", action="store_true", help="heavyball without torch.compile")
    args = ap.parse_args()
    if args.heavyball_eager:
        heavyball.utils.compile_mode = None
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = tuple(int(x) for x in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(shape, generator=gen) * 1e-2

    def stepper(make, quantized: bool):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen))
        opt = make([p])

        def step():
            p.grad = grad.clone()  # heavyball sets it to None after each step
            opt.step()

        step()  # states created (and compiled code, where the library compiles)
        if quantized:
            for state in opt.state.values():
                quantize_states(state)
            step()
        return step

    steps = {"torch fused AdamW": stepper(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), False)}
    wanted = parse_list(args.optimizers) if args.optimizers else None
    for name, make in OPTIMIZERS.items():
        if wanted is not None and not any(w in name for w in wanted):
            continue
        steps[f"{name}, fp32 states"] = stepper(make, False)
        steps[f"{name}, 8bit states"] = stepper(make, True)
    times = time_interleaved(steps, args.repeats)
    print_ratios(times, "torch fused AdamW", f"shape {shape}, {torch.get_num_threads()} thread(s), "
                 f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
