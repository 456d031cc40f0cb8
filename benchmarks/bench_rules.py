"""Rules whose C the CPU kernel generates from their math: step time and first-step seconds, C vs inductor.

AdEMAMix (qstate's, no hand-written C) and Adan (a third party's rule registered through the public API:
``test/kernels/adan_rule.py``), with 8bit states on the C kernel, against the same optimizer on inductor's
kernel (``cpu_kernel_enabled(False)``) and against its own step with float32 states; qstate's 8bit AdamW
and torch's fused fp32 AdamW for scale. One ``[n / 1024, 1024]`` weight, lr 1e-3. Each
candidate's first step (states, then the C build or inductor's compile, from an empty cache) is timed on its
own; then the candidates are timed interleaved (``_common.py``) and each median step is divided by torch's.

    python benchmarks/bench_rules.py [--size 4M] [--repeats 5] [--skip inductor,adan-inductor] [--out DIR]

Writes ``DIR/bench_rules.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

from _common import (RESULTS_DIR, cold_compile_cache, environment, median_ms, parse_list, parse_size, save_json,
                     target_line, time_interleaved, timed)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "test", "kernels"))

from adan_rule import Adan  # noqa: E402  (a third party's rule: the tests' Adan)
from qstate.optim import AdamW, AdEMAMix, cpu_kernel_enabled  # noqa: E402

BASELINE = "torch AdamW fused fp32"


class InductorKernel:
    """``opt`` whose steps run with the C kernel off: inductor's compiled kernel."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt = opt

    def step(self) -> None:
        with cpu_kernel_enabled(False):
            self.opt.step()


def candidates(skip: list[str]) -> dict[str, Callable]:
    makers: dict[str, Callable] = {
        BASELINE: lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "AdamW 8bit (C)": lambda ps: AdamW(ps, lr=1e-3, state_format="8bit"),
        "AdEMAMix 8bit (C, generated)": lambda ps: AdEMAMix(ps, lr=1e-3, state_format="8bit"),
        "Adan 8bit (C, generated)": lambda ps: Adan(ps, lr=1e-3, state_format="8bit"),
        "Adan fp32 (C, generated)": lambda ps: Adan(ps, lr=1e-3, state_format="fp32"),
    }
    if "inductor" not in skip:
        makers["AdEMAMix 8bit (inductor)"] = lambda ps: InductorKernel(AdEMAMix(ps, lr=1e-3, state_format="8bit"))
    if "inductor" not in skip and "adan-inductor" not in skip:  # minutes of compiling on 2 cores
        makers["Adan 8bit (inductor)"] = lambda ps: InductorKernel(Adan(ps, lr=1e-3, state_format="8bit"))
    return makers


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4M", help="parameter count (K/M suffixes: powers of 1024)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip", default="adan-inductor",
                        help="comma list of inductor (every inductor row), adan-inductor (default: Adan's)")
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    cold_compile_cache()  # first steps include the C build / inductor compile
    n = parse_size(args.size)
    rows = max(1, n // 1024)
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(rows, 1024, generator=gen))
    weight.grad = torch.randn(rows, 1024, generator=gen) * 1e-2
    first, steps = {}, {}
    for name, make in candidates(parse_list(args.skip)).items():
        p = torch.nn.Parameter(weight.detach().clone())  # each candidate updates its own copy
        p.grad = weight.grad
        opt = make([p])
        first[name] = timed(opt.step)
        steps[name] = opt.step
        print(f"{name}: first step {first[name]:.2f} s", flush=True)
    times = time_interleaved(steps, args.repeats)
    base = median_ms(times[BASELINE])
    result = {"environment": environment(), "size": rows * 1024, "first_step_s": first,
              "median_ms": {k: median_ms(v) for k, v in times.items()},
              "over_torch_fused": {k: median_ms(v) / base for k, v in times.items()}}
    ms = result["median_ms"]
    print(f"\n{rows * 1024:,} elements, {torch.get_num_threads()} threads; median step, ratio to {BASELINE}:")
    for name in steps:
        print(f"  {name:32s} {ms[name]:9.2f} ms  {result['over_torch_fused'][name]:6.2f}x  "
              f"(first step {first[name]:.2f} s)")
    adan = ms["Adan 8bit (C, generated)"] / ms["Adan fp32 (C, generated)"]
    result["adan_8bit_over_fp32"] = adan
    print(target_line("Adan 8bit step / Adan fp32-state step", adan, 2.0))
    print(target_line("Adan 8bit first step (s)", first["Adan 8bit (C, generated)"], 10.0))
    for rule in ("AdEMAMix", "Adan"):
        if f"{rule} 8bit (inductor)" in ms:
            ratio = result[f"{rule.lower()}_c_over_inductor"] = (ms[f"{rule} 8bit (C, generated)"]
                                                                 / ms[f"{rule} 8bit (inductor)"])
            print(f"{rule} 8bit step, C / inductor: {ratio:.3f}")
    save_json(result, args.out, "bench_rules.json")
    return result


if __name__ == "__main__":
    main()
