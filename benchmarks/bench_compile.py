"""First-step time (states + compilation) and compiled graph count on a model with many parameter shapes.

The model has 6 distinct weight shapes that every 8-bit optimizer here
quantizes (>= 4096 elements, a multiple of 256; one 4-D conv weight) and 6
distinct 1-D shapes with plain states. qstate compiles one kernel per
kernel spec whatever the shapes (on CPU a C kernel: one for the quantized states, one for the
plain ones);
torchao's AdamW8bit compiles one graph per shape. The "bf16 SR params" candidates
run the same model in bfloat16 with ``bf16_stochastic_round=True`` (on CPU the C
kernel, which rounds with its own draws).
Each candidate runs in a fresh process with an empty compile cache, so its
first step includes all of its compilation.

    python benchmarks/bench_compile.py [--candidates "qstate 8bit,torchao AdamW8bit"] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from _common import (RESULTS_DIR, cold_compile_cache, environment, parse_list, save_json, target_line,
                     third_party_adamw8bit, timed)
from qstate.optim import AdamW
from qstate.optim._engine.inductor import kernel_specs
from qstate.optim._engine.cpu.kernel import built_specs

QSTATE = ("qstate 8bit", "qstate 4bit", "qstate fp8")
#: suffix of the candidates with bfloat16 parameters rounded stochastically
BF16_SR = " bf16 SR params"
QSTATE_BF16_SR = tuple(name + BF16_SR for name in QSTATE[:2])
TORCHAO = "torchao AdamW8bit"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(16, 64, 4), nn.Flatten(), nn.Linear(256, 512), nn.Linear(512, 768),
                         nn.Linear(768, 1024), nn.Linear(1024, 384), nn.Linear(384, 128), nn.LayerNorm(128))


def run_one(name: str) -> dict:
    """In this (fresh) process: first and second step of ``name`` on :func:`model`, graphs compiled.

    ``{"skipped": why}`` when ``name`` is a third-party optimizer that is not importable.
    """
    cold_compile_cache()
    ours = name in QSTATE + QSTATE_BF16_SR
    sr = name.endswith(BF16_SR)
    if ours:
        make = lambda ps: AdamW(ps, lr=1e-3, state_format=name.split()[1],  # noqa: E731
                                bf16_stochastic_round=sr)
    else:
        makers, notes = third_party_adamw8bit()
        if name not in makers:
            return {"skipped": "; ".join(notes) if notes else f"unknown candidate {name!r}"}
        make = makers[name]
    m = model().to(torch.bfloat16 if sr else torch.float32)
    params = list(m.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make(params)
    counters = torch._dynamo.utils.counters["stats"]
    before = counters["unique_graphs"]
    first = timed(opt.step)
    graphs = counters["unique_graphs"] - before
    second = timed(opt.step)
    return {"first_step_s": first, "second_step_ms": 1e3 * second, "graphs": graphs,
            "params": len(params), "numel": sum(p.numel() for p in params),
            "shapes": len({tuple(p.shape) for p in params}),
            "kernel_specs": kernel_specs() if ours else [],
            "c_kernels": built_specs() if ours else []}


def run_fresh(name: str) -> dict:
    """:func:`run_one` in a new Python process (no compiled graph or cache shared with other candidates).

    ``{"skipped": why}`` when that process fails (``why``: the last exception line it printed).
    """
    proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "Exception" in ln]
        return {"skipped": f"its process failed: {errors[-1] if errors else f'exit code {proc.returncode}'}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidates", default=",".join(QSTATE + QSTATE_BF16_SR + (TORCHAO,)))
    ap.add_argument("--out", default=RESULTS_DIR, help="directory for bench_compile.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one candidate, print its JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one)))
        return
    rows, notes = {}, []
    for name in parse_list(args.candidates):
        r = run_fresh(name)
        if "skipped" in r:
            notes.append(f"skipped {name}: {r['skipped']}")
            print(notes[-1])
            continue
        rows[name] = r
        print(f"  {name}: first step {r['first_step_s']:.1f} s", flush=True)
    if not rows:
        raise SystemExit("no optimizer ran (see the notes above)")
    r0 = next(iter(rows.values()))
    print(f"\nmodel: {r0['params']} parameters, {r0['numel']:,} elements, {r0['shapes']} distinct shapes "
          f"(6 quantized weights, 6 plain 1-D); fresh process and empty compile cache per optimizer")
    print(f"{'optimizer':28s} {'graphs':>6s} {'C kernels':>9s} {'first step s':>12s} {'second step ms':>14s}")
    for name, r in rows.items():
        print(f"{name:28s} {r['graphs']:6d} {len(r['c_kernels']):9d} {r['first_step_s']:12.2f} "
              f"{r['second_step_ms']:14.2f}")
    for name, r in rows.items():
        if r["kernel_specs"]:
            print(f"{name} kernel specs:", *r["kernel_specs"], sep="\n  ")
    ao, q8 = rows.get(TORCHAO), rows.get("qstate 8bit")
    target = target_line("target: qstate 8bit first step / torchao AdamW8bit first step",
                         ao and q8 and q8["first_step_s"] / ao["first_step_s"], 1 / 3)
    print(target)
    save_json({"env": environment(), "command": " ".join(["python"] + sys.argv), "candidates": rows,
               "notes": notes, "targets": [target]}, args.out, "bench_compile.json")


if __name__ == "__main__":
    main()
