"""A/B of two versions of the CPU update kernel's C source on the same data, calls interleaved.

For work on ``qstate/optim/csrc/update_kernel.c``: the shared machine's load
moves whole-step timings by 10-30% from run to run, but two kernels timed
call by call in one process (the order alternating each round) see the same
load, which resolves differences of 1-2%.

``--dump FILE`` writes the configured source (the ``#define`` block of one
kernel spec, then ``update_kernel.c``) of AdamW's spec for ``--format``; edit
a copy, then compare the two. Both must keep the kernel's ``qstate_t`` layout,
and a source whose layout ``#define``s (states, bits, block sizes, dtypes)
are not those of ``--format``'s spec is refused: it would write past the
states' buffers.
The data is one ``[n / 1024, 1024]`` weight after two optimizer steps; each
call updates it and its states in place (so the kernels see the same,
slowly drifting, values).

    python benchmarks/bench_kernel_ab.py --dump /tmp/a.c [--format 8bit]
    python benchmarks/bench_kernel_ab.py /tmp/a.c /tmp/b.c [--numel 1M] [--threads 2] [--calls 200]

``--phases`` times, interleaved the same way, the kernel of ``--format``'s
spec against two versions of its own source that drop work, and torch's
fused AdamW step on the same weight: without the states' encodes (new scales
written, codes not), and without the decodes as well (the states read as
constants). Both variants compute wrong states; they only measure where the
step's time goes against the fused step's, the step-time targets' reference:

    python benchmarks/bench_kernel_ab.py --phases [--format 8bit] [--threads 1]
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from _common import parse_size
from qstate.optim import AdamW
from qstate.optim._engine.cpu import build as _cpu_build
from qstate.optim._engine.cpu import kernel as ck


def _setup(fmt: str, numel: int):
    """The weight, its gradient, its states and the kernel spec after two steps of AdamW."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(max(1, numel // 1024), 1024))
    w.grad = torch.randn_like(w)
    opt = AdamW([w], lr=1e-3, state_format=fmt)
    seen = {}
    run = ck.run

    def spy(spec, *args):
        seen["spec"] = spec
        run(spec, *args)

    ck.run = spy
    try:
        opt.step()
        opt.step()
    finally:
        ck.run = run
    if "spec" not in seen:
        raise SystemExit(f"--format {fmt}: its kernel spec does not run the C kernel on this machine")
    states = [opt.state[w][name] for name in ("exp_avg", "exp_avg_sq")]
    return w, states, seen["spec"]


#: the ``#define``s that fix the data layout a kernel reads and writes (a source configured for another
#: spec would write past the states' buffers)
_LAYOUT = re.compile(r"#define (NSTATES|PARAM_BF16|GRAD_BF16|S\d+_(?:BITS|BS|PLAIN|BF16)) (\S+)")


def _check_layout(source: Path, config: str, fmt: str) -> None:
    """Exit unless ``source`` has the layout ``#define``s of ``config`` (the data's spec)."""
    want, got = dict(_LAYOUT.findall(config)), dict(_LAYOUT.findall(source.read_text()))
    wrong = {k: (v, got.get(k)) for k, v in want.items() if got.get(k) != v}
    if wrong:
        raise SystemExit(f"{source}: not configured for the --format {fmt} data's layout "
                         f"(#define: expected, found): {wrong}; dump it with --format {fmt}")


def _load(source: Path, out_dir: Path) -> ctypes.CDLL:
    lib = out_dir / (source.stem + ".so")
    cc = _cpu_build.compiler()
    proc = subprocess.run([*cc, *_cpu_build.CFLAGS, str(source), "-o", str(lib), "-lm"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"compiling {source} failed:\n{proc.stderr}")
    dll = ctypes.CDLL(str(lib))
    dll.qstate_update.restype = None
    return dll


#: ``--phases`` variants: (name, [(anchor, replacement)]) applied to the configured source in order; each
#: anchor must occur exactly once (the kernel's source changed otherwise: update them)
#: ENCODE_BLOCKS: every block's scale is stored, then the block's codes are skipped
_NO_ENCODE = ("st[i].scale[r * st[i].scale_stride + b0 / S##i##_BS] = scale;",
              "st[i].scale[r * st[i].scale_stride + b0 / S##i##_BS] = scale; if (1) continue;")
#: DECODE_GROUP: a quantized state's values are a constant times its scale
_NO_DECODE = ("} else if (S##i##_BITS == 8) {",
              "} else if (1) { for (int64_t q_ = 0; q_ < n; q_++) vals##i[q_] = 0.01f * sc; } else if (S##i##_BITS == 8) {")
_PHASES = (
    ("without the encodes", [_NO_ENCODE]),
    ("without the encodes and decodes", [_NO_ENCODE, _NO_DECODE]),
)


def _phase_source(source: str, edits: list[tuple[str, str]]) -> str:
    for anchor, replacement in edits:
        if source.count(anchor) != 1:
            raise SystemExit(f"--phases: {anchor!r} occurs {source.count(anchor)} times in update_kernel.c, "
                             f"expected once; update _PHASES")
        source = source.replace(anchor, replacement)
    return source


def _fused_step(w: torch.Tensor):
    """torch's fused AdamW step on a copy of ``w`` (and its gradient), after two warm-up steps."""
    ref = torch.nn.Parameter(w.detach().clone())
    ref.grad = w.grad.clone()
    opt = torch.optim.AdamW([ref], lr=1e-3, fused=True)
    opt.step()
    opt.step()
    return opt.step


def _interleaved(calls: list, rounds: int) -> list[float]:
    """Median seconds of each zero-argument call, timed call by call, the order reversing every round."""
    seconds: list[list[float]] = [[] for _ in calls]
    for call in calls:  # warm-up
        call()
    order = list(range(len(calls)))
    for r in range(rounds):
        for i in (order if r % 2 else order[::-1]):
            start = time.perf_counter()
            calls[i]()
            seconds[i].append(time.perf_counter() - start)
    return [statistics.median(s) for s in seconds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="*", type=Path, help="two configured kernel sources (A, B)")
    ap.add_argument("--dump", type=Path, help="write the configured source of --format's AdamW kind here")
    ap.add_argument("--format", default="8bit")
    ap.add_argument("--numel", default="1M")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--calls", type=int, default=200, help="calls of each kernel")
    ap.add_argument("--phases", action="store_true",
                    help="time the kernel, its variants without encodes and decodes, and torch fused AdamW")
    args = ap.parse_args()
    w, states, spec = _setup(args.format, parse_size(args.numel))
    configured = ck.kernel_source(spec, w.grad.dtype)
    if args.dump:
        args.dump.write_text(configured)
        print(f"wrote {args.dump} ({spec.tag()})")
        return
    if args.phases:
        _run_phases(args, w, states, spec, configured)
        return
    if len(args.sources) != 2:
        ap.error("give two sources (or --dump FILE)")
    for source in args.sources:
        _check_layout(source, ck._config(spec, w.grad.dtype), args.format)
    call_args = _call_args(args, w, states, spec)
    with tempfile.TemporaryDirectory() as tmp:
        dlls = [_load(src, Path(tmp)) for src in args.sources]
        a, b = (1e3 * t for t in _interleaved([lambda d=d: d.qstate_update(*call_args) for d in dlls], args.calls))
    print(f"{spec.tag()}, {w.numel():,} elements, {args.threads} thread(s), median of {args.calls} calls each")
    print(f"  A {args.sources[0]}: {a:.3f} ms")
    print(f"  B {args.sources[1]}: {b:.3f} ms   B / A = {b / a:.3f}")



def _call_args(args, w, states, spec) -> tuple:
    """``qstate_update``'s arguments for the weight and its states (AdamW's scalars, no stochastic rounding)."""
    arr, rows, row_len = ck.state_slots(spec, w, states, [ck._table_pointers(e) for e in spec.states])
    hyper = (ctypes.c_float * 9)(1e-3, 1.0, 0.9, 0.999, 1e-8, 0.01, 0.1, 0.05, 10.0)
    return (ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(w.grad.data_ptr()), arr, hyper,
            ctypes.c_int64(rows), ctypes.c_int64(row_len), ctypes.c_int(args.threads), ctypes.c_uint64(0),
            ctypes.c_int64(0))


def _run_phases(args, w, states, spec, configured: str) -> None:
    """``--phases``: the kernel and its variants (:data:`_PHASES`) against torch's fused AdamW step."""
    torch.set_num_threads(args.threads)
    names = ["kernel", *(name for name, _ in _PHASES)]
    sources = [configured, *(_phase_source(configured, edits) for _, edits in _PHASES)]
    call_args = _call_args(args, w, states, spec)
    with tempfile.TemporaryDirectory() as tmp:
        dlls = []
        for k, text in enumerate(sources):
            path = Path(tmp) / f"phase{k}.c"
            path.write_text(text)
            dlls.append(_load(path, Path(tmp)))
        calls = [lambda d=d: d.qstate_update(*call_args) for d in dlls]
        *kernels, fused = _interleaved([*calls, _fused_step(w)], args.calls)
    print(f"{spec.tag()}, {w.numel():,} elements, {args.threads} thread(s), median of {args.calls} calls each; "
          f"torch fused AdamW: {1e3 * fused:.3f} ms")
    width = max(len(n) for n in names)
    for name, t in zip(names, kernels):
        print(f"  {name:<{width}}  {1e3 * t:7.3f} ms  {t / fused:5.2f}x fused")


if __name__ == "__main__":
    main()
