"""Helpers shared by the benchmarks: sizes, interleaved timing, state bytes, optional baselines, output.

Timing rule: candidates compared in one table are timed **interleaved** in one
process (round ``r`` runs one step of every candidate, the starting candidate
rotating per round), so that load from other processes on a shared machine
lands on all of them alike; the figure reported is the median over rounds.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Optional

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
# the benchmarks import the qstate of this checkout, installed or not
sys.path.insert(0, os.path.dirname(_HERE))

RESULTS_DIR = os.path.join(_HERE, "results")

_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s: str) -> int:
    """``"16M"`` -> ``16 * 2**20`` (suffixes K, M, G are powers of 1024; no suffix: a plain count)."""
    s = s.strip().upper()
    if not s:
        raise ValueError("size: expected e.g. 1M, 16M or 4096, got an empty string")
    mult = _SUFFIX.get(s[-1], 1)
    try:
        n = int(float(s[:-1] if s[-1] in _SUFFIX else s) * mult)
    except ValueError:
        raise ValueError(f"size: expected e.g. 1M, 16M or 4096, got {s!r}") from None
    if n < 1:
        raise ValueError(f"size: expected a positive count, got {s!r}")
    return n


def parse_list(s: str) -> list[str]:
    """``"a,b,,c"`` -> ``["a", "b", "c"]``."""
    return [x.strip() for x in s.split(",") if x.strip()]


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_interleaved(steps: dict[str, Callable[[], Any]], repeats: int,
                     sync: Optional[Callable[[], Any]] = None) -> dict[str, list[float]]:
    """Per candidate, the seconds of each of ``repeats`` calls, timed round-robin (see module docstring).

    ``sync`` (untimed) runs before each call: ``torch.distributed.barrier`` makes every rank time the
    same candidate at the same moment.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            if sync is not None:
                sync()
            times[name].append(timed(steps[name]))
    return times


def median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def print_ratios(times: dict[str, list[float]], base: str, header: str) -> None:
    """``header``, then each candidate's median milliseconds and its ratio to ``base``'s."""
    base_ms = median_ms(times[base])
    print(header)
    print(f"{'candidate':32s} {'ms':>9s} {'/ base':>8s}")
    for name, t in times.items():
        ms = median_ms(t)
        print(f"{name:32s} {ms:9.1f} {ms / base_ms:8.2f}")


def _storages(t: torch.Tensor) -> Iterable[torch.Tensor]:
    """The plain tensors holding ``t``'s data (inner tensors of wrapper subclasses, recursively)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for n in names:
        yield from _storages(getattr(t, n))


def state_nbytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of this process's optimizer state: every distinct storage under ``opt.state`` counted once.

    Quantized states (qstate, torchao) count their codes, scales and maps; a
    DTensor counts its local shard; a map shared by several states counts once.
    """
    seen: dict[tuple, int] = {}
    for st in opt.state.values():
        for v in st.values():
            if not isinstance(v, torch.Tensor):
                continue
            for t in _storages(v):
                s = t.untyped_storage()
                seen[(t.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def try_import(what: str, attr: Optional[str] = None) -> tuple[Any, Optional[str]]:
    """``(module or attribute, None)``, or ``(None, why)`` when the import fails (the benchmark skips it)."""
    import importlib

    try:
        mod = importlib.import_module(what)
        return (getattr(mod, attr) if attr else mod), None
    except Exception as e:  # ImportError, or a broken install raising anything at import
        return None, f"{what}{'.' + attr if attr else ''} not importable: {type(e).__name__}: {e}"


def third_party_adamw8bit() -> tuple[dict[str, Callable], list[str]]:
    """Factories ``params -> optimizer`` of the importable 8-bit AdamWs (torchao, bitsandbytes), and skip notes."""
    makers: dict[str, Callable] = {}
    notes: list[str] = []
    ao, why = try_import("torchao.optim", "AdamW8bit")
    if ao is None:
        notes.append(f"skipped torchao AdamW8bit: {why}")
    else:
        makers["torchao AdamW8bit"] = lambda ps: ao(ps, lr=1e-3)
    bnb, why = try_import("bitsandbytes.optim", "AdamW8bit")
    if bnb is None:
        notes.append(f"skipped bitsandbytes AdamW8bit: {why}")
    else:
        makers["bitsandbytes AdamW8bit"] = lambda ps: bnb(ps, lr=1e-3)
    return makers, notes


def cold_compile_cache() -> str:
    """Point torch.compile's on-disk caches at a new empty directory, removed at exit; returns it.

    Call before anything compiles: first-step times then include compilation,
    not a hit in the cache of an earlier run. Child processes inherit it.
    """
    path = tempfile.mkdtemp(prefix="qstate_bench_compile_cache_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or ``"unknown"``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def kernel_vector_paths() -> str:
    """Which vector paths the C kernel's build takes here: ``"AVX-512 VBMI + AVX2"``, ``"AVX2"`` or
    ``"portable"`` (the compiler's predefined macros under the kernel's flags), or ``"no compiler"``."""
    import subprocess

    from qstate.optim._engine.cpu import build as _cpu_build

    cc = _cpu_build.compiler()
    if cc is None:
        return "no compiler"
    flags = [f for f in _cpu_build.CFLAGS if f.startswith("-m")]
    macros = subprocess.run([*cc, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True).stdout
    have = set(line.split()[1] for line in macros.splitlines() if line.startswith("#define "))
    if {"__AVX512VBMI__", "__AVX512BW__"} <= have:
        return "AVX-512 VBMI + AVX2"
    return "AVX2" if "__AVX2__" in have else "portable"


def environment() -> dict:
    """What the figures depend on: versions, threads, CPU count and model, the C kernel's vector paths."""
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "cpu": cpu_model(), "kernel_vector_paths": kernel_vector_paths(), "date": time.strftime("%Y-%m-%d")}


def save_json(obj: Any, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print(f"saved {path}")
    return path


def target_line(what: str, value: Optional[float], limit: float, at_most: bool = True) -> str:
    """``"<what>: 1.23 (target <= 1.5): met"`` (or ``not measured`` when ``value`` is None)."""
    if value is None:
        return f"{what}: not measured (target {'<=' if at_most else '>='} {limit:.3g})"
    met = value <= limit if at_most else value >= limit
    return f"{what}: {value:.3g} (target {'<=' if at_most else '>='} {limit:.3g}): {'met' if met else 'NOT met'}"
