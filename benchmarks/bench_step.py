"""Optimizer step time and state memory: qstate AdamW (each format, eager and compiled) vs torch AdamW.

On CPU the compiled 8bit/4bit/fp8 step is the C kernel; "compiled, inductor" rows
time the same optimizer with it off (``cpu_kernel_enabled(False)``).
For each parameter count ``n`` every candidate optimizer holds its own states
over one shared set of parameters (a ``[n / 1024, 1024]`` weight and a
``[1024]`` bias, or with ``--weights K`` K weights of ``[n / K / 1024, 1024]``
and K biases) and gradients. After each candidate's first step (states,
compilation from an empty compile cache; timed on its own) the candidates are
timed interleaved (see ``_common.py``) and each median step is divided by
torch's fused fp32 AdamW's.
torchao's and bitsandbytes' 8-bit AdamW join when importable; a candidate
whose first step raises is dropped with a printed note.
With ``--device cuda`` parameters, gradients and states live on the GPU, each
timed step ends with ``torch.cuda.synchronize()``, and the compiled step is
inductor's Triton kernel (no "compiled, inductor" rows: the C kernel is CPU-only).

    python benchmarks/bench_step.py [--sizes 1M,16M,64M] [--repeats 5] [--weights 1] [--only fused,8bit]
                                    [--skip inductor] [--out DIR] [--device cpu|cuda]

Writes ``DIR/bench_step.json`` and, when matplotlib imports
(``pip install -e ".[bench]"``), ``DIR/bench_step.png``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from _common import (RESULTS_DIR, cold_compile_cache, environment, median_ms, parse_list, parse_size, save_json,
                     state_nbytes, target_line, third_party_adamw8bit, time_interleaved, timed)
from qstate.optim import AdamW, cpu_kernel_enabled

BASELINE = "torch fused"
QSTATE_FORMATS = ("8bit", "4bit", "fp8", "bf16", "fp32")
#: formats whose compiled CPU step is the C kernel (qstate/optim/_cpu_kernel.py); also timed with inductor's
C_KERNEL_FORMATS = ("8bit", "4bit", "fp8")


class InductorKernel:
    """``opt`` whose steps run with the C kernel off: the compiled inductor kernel for every kind."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt, self.state = opt, opt.state

    def step(self) -> None:
        with cpu_kernel_enabled(False):
            self.opt.step()


def candidates(device: str = "cpu") -> tuple[dict[str, Callable], list[str]]:
    """Factories ``params -> optimizer`` (lr 1e-3, other arguments default), and notes on skipped ones."""
    makers: dict[str, Callable] = {
        BASELINE: lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "torch foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    }
    for fmt in QSTATE_FORMATS:
        for compile in (True, False):
            makers[f"qstate {fmt} {'compiled' if compile else 'eager'}"] = (
                lambda ps, fmt=fmt, compile=compile: AdamW(ps, lr=1e-3, state_format=fmt, compile=compile))
    for fmt in C_KERNEL_FORMATS if device == "cpu" else ():
        makers[f"qstate {fmt} compiled, inductor"] = (
            lambda ps, fmt=fmt: InductorKernel(AdamW(ps, lr=1e-3, state_format=fmt)))
    others, notes = third_party_adamw8bit()
    makers.update(others)
    return makers, notes


def params_and_grads(n: int, weights: int = 1, device: str = "cpu") -> list[torch.nn.Parameter]:
    """``weights`` weights of ``[n / weights / 1024, 1024]`` and as many ``[1024]`` biases, with gradients."""
    torch.manual_seed(0)
    rows = max(1, n // weights // 1024)
    ps = [torch.nn.Parameter(torch.randn(rows, 1024, device=device)) for _ in range(weights)]
    ps += [torch.nn.Parameter(torch.randn(1024, device=device)) for _ in range(weights)]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def _synced_step(opt: torch.optim.Optimizer, device: str) -> Callable[[], None]:
    """``opt.step``, waiting for the device's queued work on an accelerator (the time a caller sees)."""
    if device == "cpu":
        return opt.step

    def step() -> None:
        opt.step()
        torch.accelerator.synchronize()
    return step


def bench_size(n: int, makers: dict[str, Callable], repeats: int, notes: list[str], weights: int = 1,
               device: str = "cpu") -> dict:
    """One size: per candidate the median step (ms), its ratio to the baseline, state bytes and first step."""
    ps = params_and_grads(n, weights, device)
    numel = sum(p.numel() for p in ps)
    opts, rows = {}, {}
    for name, make in makers.items():
        opt = make(ps)
        try:
            first = timed(_synced_step(opt, device))  # creates the states, compiles
        except Exception as e:
            notes.append(f"dropped {name} at {numel} parameters: its first step raised "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            print(notes[-1], flush=True)
            continue
        opts[name] = opt
        rows[name] = {"first_step_s": first, "state_bytes": state_nbytes(opt)}
        print(f"  first step {name:24s} {first:8.2f} s", flush=True)
    times = time_interleaved({name: _synced_step(opt, device) for name, opt in opts.items()}, repeats)
    base = rows.get(BASELINE)
    for name, row in rows.items():
        row["times_ms"] = [1e3 * t for t in times[name]]
        row["median_ms"] = median_ms(times[name])
        row["state_bytes_per_param"] = row["state_bytes"] / numel
    for row in rows.values():
        row["time_vs_fused"] = row["median_ms"] / base["median_ms"] if base else None
        row["memory_vs_fused"] = row["state_bytes"] / base["state_bytes"] if base else None
    return {"numel": numel, "parameters": len(ps), "candidates": rows}


def print_table(label: str, size: dict) -> None:
    print(f"\n{label}: {size['numel']:,} elements in {size['parameters']} parameters; ratios to {BASELINE} fp32 AdamW")
    print(f"{'optimizer':26s} {'step ms':>9s} {'x fused':>8s} {'state B/param':>13s} {'first step s':>12s}")
    for name, r in size["candidates"].items():
        ratio = f"{r['time_vs_fused']:8.2f}" if r["time_vs_fused"] is not None else f"{'-':>8s}"
        print(f"{name:26s} {r['median_ms']:9.2f} {ratio} {r['state_bytes_per_param']:13.3f} "
              f"{r['first_step_s']:12.2f}")


def targets(sizes: dict) -> list[str]:
    """The step-time targets (README: Performance targets), per size (``not measured`` when a candidate is absent)."""
    lines = []
    for label, size in sizes.items():
        c = size["candidates"]
        q8 = c.get("qstate 8bit compiled")
        lines.append(target_line(f"{label}: qstate 8bit compiled / torch fused", q8 and q8["time_vs_fused"], 1.5))
        ao = c.get("torchao AdamW8bit")
        lines.append(target_line(f"{label}: torchao AdamW8bit / qstate 8bit compiled",
                                 ao and q8 and ao["median_ms"] / q8["median_ms"], 10.0, at_most=False))
    return lines


def plot(sizes: dict, path: str) -> None:
    """Step-time ratio per size (log scale) and state bytes per parameter at the largest size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"no plot: matplotlib not importable ({e}); pip install -e \".[bench]\"")
        return
    labels = list(sizes)
    names = list(dict.fromkeys(n for s in sizes.values() for n in s["candidates"]))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 6), gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.cm.tab20.colors
    for i, name in enumerate(names):
        ys = [sizes[s]["candidates"].get(name, {}).get("time_vs_fused") for s in labels]
        ax.plot(labels, [float("nan") if y is None else y for y in ys], marker="o", label=name,
                color=colors[i % len(colors)], ls="--" if "eager" in name else "-")
    ax.axhline(1.5, color="k", ls=":", lw=0.8, label="target, 8bit compiled")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel(f"median step time / {BASELINE} AdamW")
    last = sizes[labels[-1]]["candidates"]
    bx.barh(list(last), [r["state_bytes_per_param"] for r in last.values()],
            color=[colors[names.index(n) % len(colors)] for n in last])
    bx.invert_yaxis()
    bx.set_xlabel(f"state bytes / parameter ({labels[-1]})")
    bx.tick_params(axis="y", labelsize=7)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=5, fontsize=7)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M,64M", help="parameter counts (K/M/G = 2**10/20/30)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per candidate (median reported)")
    ap.add_argument("--weights", type=int, default=1,
                    help="split each size into this many [rows, 1024] weights, each with a [1024] bias")
    ap.add_argument("--only", default="", help="comma list of substrings of candidate names (baseline kept)")
    ap.add_argument("--skip", default="", help="comma list of substrings of candidate names to leave out")
    ap.add_argument("--out", default=RESULTS_DIR, help="directory for bench_step.json / .png")
    ap.add_argument("--device", default="cpu", help="where parameters, gradients and states live (cpu, cuda)")
    args = ap.parse_args()
    cold_compile_cache()  # first steps include compilation
    makers, notes = candidates(args.device)
    only = parse_list(args.only)
    if only:
        makers = {k: v for k, v in makers.items() if k == BASELINE or any(o in k for o in only)}
    skip = parse_list(args.skip)
    makers = {k: v for k, v in makers.items() if k == BASELINE or not any(o in k for o in skip)}
    for note in notes:
        print(note)
    results = {"env": environment(), "device": args.device, "command": " ".join(["python"] + sys.argv),
               "repeats": args.repeats, "notes": notes, "sizes": {}}
    env = results["env"]
    print(f"{env['cpu']}, {env['threads']} threads, C kernel vector paths: {env['kernel_vector_paths']}")
    if args.device != "cpu":
        print(f"device: {torch.accelerator.current_accelerator()} ({torch.cuda.get_device_name()})")
    for label in parse_list(args.sizes):
        print(f"== {label}", flush=True)
        results["sizes"][label] = bench_size(parse_size(label), makers, args.repeats, notes, args.weights, args.device)
    for label, size in results["sizes"].items():
        print_table(label, size)
    results["targets"] = targets(results["sizes"])
    print("\ntargets:", *results["targets"], sep="\n  ")
    save_json(results, args.out, "bench_step.json")
    plot(results["sizes"], f"{args.out}/bench_step.png")


if __name__ == "__main__":
    main()
