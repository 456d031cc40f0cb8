"""A whole model's optimizer step: qstate against torch's fused and foreach AdamW, and 8-bit AdamWs.

The parameters are a GPT-like model's (no forward pass: the step is what is timed): a tied
``[vocab, d]`` embedding, then per layer a ``[3d, d]`` qkv and ``[d, d]`` output projection, a
``[4d, d]`` up and ``[d, 4d]`` down projection, their four biases and two ``[d]`` norm weights (12
tensors), and a final norm: ``12 * layers + 2`` tensors. The defaults (8 layers, d 512, vocab 8192)
give 98 tensors and 29.4M parameters; ``--layers 24`` gives 290 tensors.

Each optimizer has its own copy of the parameters and of one set of gradients, steps twice untimed
(states, compilation, prepared calls), then all are timed interleaved (``_common.py``). Candidates:

* ``torch fused`` / ``torch foreach``: ``torch.optim.AdamW(fused=True)`` / ``(foreach=True)``, fp32;
* ``qstate <fmt>``: ``qstate.optim.AdamW(state_format=fmt)``, ``compile=True`` (default
  ``min_quantize_numel``: norms and biases keep float32 states);
* ``torchao AdamW8bit``, ``bitsandbytes AdamW8bit`` where importable.

Reported per candidate: the median step (``--device cuda``: ended by ``torch.cuda.synchronize()``),
its ratio to torch fused, the host time of a step (until ``step()`` returns, before any
synchronization: on CPU the step itself) and per tensor, and the state bytes per parameter.

    python benchmarks/bench_model_step.py [--device cpu|cuda] [--layers 8] [--d-model 512] [--vocab 8192]
                                          [--formats 8bit,4bit,fp8] [--repeats 11] [--threads N]
                                          [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch

from _common import (RESULTS_DIR, environment, median_ms, parse_list, save_json, state_nbytes, target_line,
                     third_party_adamw8bit)
from qstate.optim import AdamW

BASELINE = "torch fused"


def model_shapes(layers: int, d: int, vocab: int) -> list[tuple[int, ...]]:
    """The parameter shapes of the GPT-like model (module docstring)."""
    shapes: list[tuple[int, ...]] = [(vocab, d)]
    for _ in range(layers):
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
        shapes += [(d,), (d,)]  # the two norms' biases
    shapes.append((d,))
    return shapes


def _params(shapes, device: str, grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    return ps


def _timed_step(opt: torch.optim.Optimizer, sync: Callable[[], None]) -> tuple[float, float]:
    """(host seconds until ``step()`` returns, seconds until the device is done)."""
    t0 = time.perf_counter()
    opt.step()
    t1 = time.perf_counter()
    sync()
    return t1 - t0, time.perf_counter() - t0


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--formats", default="8bit,4bit,fp8")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--no-third-party", action="store_true", help="skip torchao and bitsandbytes")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.threads:
        torch.set_num_threads(args.threads)

    shapes = model_shapes(args.layers, args.d_model, args.vocab)
    numel = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(s, generator=gen) * 1e-2).to(args.device) for s in shapes]

    makers: dict[str, Callable] = {
        BASELINE: lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "torch foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    }
    for fmt in parse_list(args.formats):
        makers[f"qstate {fmt}"] = lambda ps, fmt=fmt: AdamW(ps, lr=1e-3, state_format=fmt)
    notes: list[str] = []
    if not args.no_third_party:
        third, notes = third_party_adamw8bit()
        makers.update(third)
    opts: dict[str, torch.optim.Optimizer] = {}
    for name, make in makers.items():
        try:
            opts[name] = make(_params(shapes, args.device, grads))
            for _ in range(2):  # states, compilation, prepared calls
                _timed_step(opts[name], sync)
        except Exception as e:  # a third-party optimizer without this device's kernels
            opts.pop(name, None)
            notes.append(f"skipped {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")

    host: dict[str, list[float]] = {n: [] for n in opts}
    wall: dict[str, list[float]] = {n: [] for n in opts}
    names = list(opts)
    for r in range(args.repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            h, w = _timed_step(opts[name], sync)
            host[name].append(h)
            wall[name].append(w)

    fused = median_ms(wall[BASELINE])
    print(f"{len(shapes)} tensors, {numel / 1e6:.1f}M parameters (layers {args.layers}, d {args.d_model}, "
          f"vocab {args.vocab}) on {args.device}, {torch.get_num_threads()} threads; median of {args.repeats}")
    print(f"{'optimizer':24s} {'step ms':>8s} {'x fused':>8s} {'host ms':>8s} {'host us/tensor':>15s} "
          f"{'state B/param':>14s}")
    rows = {}
    for name in names:
        ms, host_ms = median_ms(wall[name]), median_ms(host[name])
        rows[name] = {"step_ms": ms, "x_fused": ms / fused, "host_ms": host_ms,
                      "host_us_per_tensor": 1e3 * host_ms / len(shapes),
                      "state_bytes_per_param": state_nbytes(opts[name]) / numel}
        r = rows[name]
        print(f"{name:24s} {ms:8.2f} {r['x_fused']:8.2f} {host_ms:8.2f} {r['host_us_per_tensor']:15.1f} "
              f"{r['state_bytes_per_param']:14.2f}")
    for note in notes:
        print(note)
    print("targets:")
    q8 = rows.get("qstate 8bit")
    limit = 1.3 if args.device == "cuda" else 1.2
    print("  " + target_line(f"qstate 8bit whole-model step / torch fused ({args.device})",
                             q8 and q8["x_fused"], limit))
    bnb = rows.get("bitsandbytes AdamW8bit")
    if args.device == "cuda":
        print("  " + target_line("qstate 8bit step / bitsandbytes AdamW8bit step",
                                 q8 and bnb and q8["step_ms"] / bnb["step_ms"], 1.0))
    save_json({"command": " ".join(sys.argv), "env": environment(), "device": args.device, "tensors": len(shapes),
               "params": numel, "layers": args.layers, "d_model": args.d_model, "vocab": args.vocab,
               "results": rows, "notes": notes}, args.out, f"bench_model_step_{args.device}.json")


if __name__ == "__main__":
    main(sys.argv[1:])
