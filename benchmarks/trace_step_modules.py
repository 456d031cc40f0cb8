"""Which qstate modules one FSDP2 optimizer step passes through, and the package's import graph.

Two measurements of the code's layering, for comparing commits (the script uses
only public APIs, so the same file runs against any checkout):

* **runtime**: 2 gloo ranks on CPU (``qstate.launch.run_ranks``: spawned
  processes) build a 3-layer MLP with uneven shards (``Linear(37, 64)``,
  ``Linear(64, 37)``, ``Linear(37, 10)``), ``fully_shard`` each layer and the
  model, make ``qstate.optim.AdamW(state_format=--format, min_quantize_numel=
  --min-quantize-numel)`` (default 256: the weights get quantized states, the
  biases fp32 ones), once with the default compile setting and once with
  ``compile=False``, and run ``--warmup`` steps (forward, backward, step). Rank 0
  then traces ONE further ``optimizer.step()`` with ``sys.setprofile`` ("call"
  events), keeping the frames whose file lies in the qstate package, named by
  module (``qstate.optim._step``). A call edge ``A -> B`` is a call into module
  ``B`` whose nearest qstate caller frame (through any torch frames between,
  e.g. DTensor's dispatch) is in module ``A != B``; ``direct`` counts the calls
  whose immediate caller is ``A`` itself. A **return trip** is an edge
  ``B -> A`` where ``A -> B`` is also an edge of the step (two modules calling
  each other); a longer loop (``A -> B -> C -> A``) shows in the **call
  cycles**, the strongly connected components of more than one module of the
  edges. Reported per module and per package (``qstate.optim``,
  ``qstate.dtensor_rules``, ...; a top-level module is its own package).
  ``--warmup 0`` traces the first step instead (state creation, and DTensor's
  sharding rules before its cache holds them).
* **static**: every ``.py`` of the imported qstate package parsed with ``ast``:
  each ``import`` / ``from ... import`` naming qstate (relative ones resolved),
  at module level or inside functions (``TYPE_CHECKING`` blocks kept apart);
  an imported name that is a submodule counts as that submodule. Reported: each
  module's qstate imports, the strongly connected components of more than one
  module (import cycles) with all imports and with module-level ones only, and
  the same at package level, with the imports that make up a cycle between
  ``qstate.optim`` and ``qstate.dtensor_rules``.

``import qstate`` resolves to the checkout in the current directory (the
script puts it first on ``sys.path`` and prints ``qstate.__file__``): run it
from the root of the checkout to measure, e.g. from another worktree:

    python benchmarks/trace_step_modules.py [--format 8bit] [--compile default,eager] [--warmup 3]
        [--min-quantize-numel 256] [--json PATH] [--no-import-list]
    cd ../old && python ../new/benchmarks/trace_step_modules.py --format 4bit
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from typing import Iterable, Optional

# the qstate of the checkout this is run from (its root), installed or not
_ROOT = os.getcwd()
if os.path.isdir(os.path.join(_ROOT, "qstate")):
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

import qstate  # noqa: E402
from qstate.launch import run_ranks  # noqa: E402

PKG_DIR = os.path.dirname(os.path.abspath(qstate.__file__))
PKG_PARENT = os.path.dirname(PKG_DIR)
FOCUS = ("qstate.optim", "qstate.dtensor_rules")  # the two packages whose cycle the redesign removed


# ----------------------------------------------------------------------------- names

def module_of(filename: str) -> Optional[str]:
    """``.../qstate/optim/_step.py`` -> ``qstate.optim._step``; None outside the qstate package."""
    path = os.path.abspath(filename)
    if not path.startswith(PKG_DIR + os.sep) or not path.endswith(".py"):
        return None
    parts = os.path.relpath(path, PKG_PARENT)[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(mod: str) -> str:
    """``qstate.optim._step`` -> ``qstate.optim``; a top-level module (``qstate._api``) is its own package."""
    parts = mod.split(".")
    if len(parts) == 2 and not os.path.isdir(os.path.join(PKG_DIR, parts[1])):
        return mod
    return ".".join(parts[:2])


def all_modules() -> dict[str, str]:
    """Module name -> file, for every ``.py`` under the package."""
    out = {}
    for d, dirs, files in os.walk(PKG_DIR):
        dirs[:] = sorted(x for x in dirs if not x.startswith((".", "__pycache__")))
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(d, f)
                out[module_of(p)] = p
    return out


def short(mod: str) -> str:
    return mod[len("qstate."):] if mod.startswith("qstate.") else mod


# ----------------------------------------------------------------------------- runtime trace

class StepTracer:
    """``sys.setprofile`` hook: calls into qstate modules and the module -> module edges between them."""

    def __init__(self):
        self.calls: Counter = Counter()  # module -> calls into its functions
        self.edges: Counter = Counter()  # (caller module, callee module) -> calls
        self.direct: Counter = Counter()  # the same, immediate caller frame in the caller module
        self.functions: Counter = Counter()  # "module:function" -> calls
        self._names: dict = {}  # filename -> module or None

    def _mod(self, code) -> Optional[str]:
        fn = code.co_filename
        if fn not in self._names:
            self._names[fn] = module_of(fn)
        return self._names[fn]

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        mod = self._mod(frame.f_code)
        if mod is None:
            return
        self.calls[mod] += 1
        self.functions[f"{mod}:{frame.f_code.co_name}"] += 1
        back, direct = frame.f_back, True
        while back is not None and back.f_code is not _TRACE_CODE:  # callers outside the step: not an edge
            caller = self._mod(back.f_code)
            if caller is not None:
                if caller != mod:
                    self.edges[(caller, mod)] += 1
                    if direct:
                        self.direct[(caller, mod)] += 1
                return
            back, direct = back.f_back, False

    def trace(self, fn):
        sys.setprofile(self)
        try:
            return fn()
        finally:
            sys.setprofile(None)


_TRACE_CODE = StepTracer.trace.__code__


def return_trips(edges: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs ``(A, B)``, ``A < B``, with both ``A -> B`` and ``B -> A`` among ``edges``."""
    es = set(edges)
    return sorted((a, b) for a, b in es if a < b and (b, a) in es)


def _edge_sccs(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    g: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        g[a].add(b)
    return sccs({x for e in edges for x in e}, g)


def summarize_trace(t: StepTracer) -> dict:
    pkg_edges: Counter = Counter()
    for (a, b), n in t.edges.items():
        if package_of(a) != package_of(b):
            pkg_edges[(package_of(a), package_of(b))] += n
    return {
        "modules": dict(sorted(t.calls.items())),
        "packages": sorted({package_of(m) for m in t.calls}),
        "edges": [{"from": a, "to": b, "calls": n, "direct": t.direct.get((a, b), 0)}
                  for (a, b), n in sorted(t.edges.items())],
        "return_trips": [list(p) for p in return_trips(t.edges)],
        "package_edges": [{"from": a, "to": b, "calls": n} for (a, b), n in sorted(pkg_edges.items())],
        "package_return_trips": [list(p) for p in return_trips(pkg_edges)],
        "call_cycles": _edge_sccs(t.edges),
        "package_call_cycles": _edge_sccs(pkg_edges),
        "functions": dict(sorted(t.functions.items())),
    }


def _make_optimizer(params, fmt: str, compile_setting: str, min_numel: int):
    from qstate.optim import AdamW

    kw = dict(lr=1e-2, state_format=fmt, min_quantize_numel=min_numel)
    if compile_setting == "eager":
        if "compile" not in inspect.signature(AdamW).parameters:
            return None
        kw["compile"] = False
    return AdamW(params, **kw)


def trace_rank(rank: int, world_size: int, fmt: str, compile_settings: list[str], warmup: int,
               min_numel: int, out_path: str) -> None:
    """Run on every rank; rank 0 traces one step per compile setting and writes the result to ``out_path``."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    results = {}
    for setting in compile_settings:
        torch.manual_seed(0)  # the same model on every rank
        model = nn.Sequential(nn.Linear(37, 64), nn.ReLU(), nn.Linear(64, 37), nn.ReLU(), nn.Linear(37, 10))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = _make_optimizer(model.parameters(), fmt, setting, min_numel)
        if opt is None:
            results[setting] = {"skipped": "AdamW takes no compile argument"}
            continue
        gen = torch.Generator().manual_seed(1 + rank)

        def fwd_bwd():
            x = torch.randn(8, 37, generator=gen)
            y = torch.randint(0, 10, (8,), generator=gen)
            nn.functional.cross_entropy(model(x), y).backward()

        for _ in range(warmup):
            fwd_bwd()
            opt.step()
            opt.zero_grad()
        fwd_bwd()
        dist.barrier()
        tracer = StepTracer()
        if rank == 0:
            tracer.trace(opt.step)
        else:
            opt.step()
        dist.barrier()
        st = next(iter(opt.state.values()))
        results[setting] = summarize_trace(tracer) if rank == 0 else {}
        if rank == 0:
            results[setting]["state_keys"] = sorted(st)
            results[setting]["state_types"] = sorted({type(v).__name__ for s in opt.state.values()
                                                      for v in s.values()})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def run_trace(fmt: str, compile_settings: list[str], warmup: int, min_numel: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        run_ranks(trace_rank, 2, fmt, compile_settings, warmup, min_numel, path)
        with open(path) as f:
            return json.load(f)


# ----------------------------------------------------------------------------- static import graph

def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(name: str, mods: dict[str, str]) -> Optional[str]:
    """The longest qstate module that ``name`` (dotted) names or lies in."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in mods:
            return cand
        parts.pop()
    return None


def imports_of(mod: str, path: str, mods: dict[str, str]) -> list[tuple[str, str]]:
    """``(target module, where)`` for each qstate import in ``path``; ``where``: module / function / type_checking."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_pkg = os.path.basename(path) == "__init__.py"
    package = mod if is_pkg else mod.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "qstate" or a.name.startswith("qstate."):
                    t = _resolve(a.name, mods)
                    if t is not None:
                        found.append((t, where))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            if full == "qstate" or full.startswith("qstate."):
                for a in node.names:
                    sub = f"{full}.{a.name}"
                    t = sub if sub in mods else _resolve(full, mods)
                    if t is not None:
                        found.append((t, where))
        for child in ast.iter_child_nodes(node):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                w = "function" if where == "module" else where
            elif isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                w = "type_checking"
            else:
                w = where
            visit(child, w)

    visit(tree, "module")
    return [(t, w) for t, w in found if t != mod]


def sccs(nodes: Iterable[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return sorted(out)


def import_graph() -> dict:
    mods = all_modules()
    imports = {m: imports_of(m, p, mods) for m, p in sorted(mods.items())}
    result = {"modules": len(mods), "imports": {m: sorted({f"{t} ({w})" if w != "module" else t for t, w in ims})
                                                for m, ims in imports.items()}}
    for label, kinds in (("all", ("module", "function")), ("module_level", ("module",))):
        g: dict[str, set[str]] = defaultdict(set)
        pg: dict[str, set[str]] = defaultdict(set)
        for m, ims in imports.items():
            for t, w in ims:
                if w in kinds:
                    g[m].add(t)
                    if package_of(m) != package_of(t):
                        pg[package_of(m)].add(package_of(t))
        comps = sccs(mods, g)
        result[label] = {
            "edges": sum(len(v) for v in g.values()),
            "sccs": comps,
            "package_sccs": sccs({package_of(m) for m in mods}, pg),
            "focus_cycle": {f"{a} -> {b}": sorted({f"{m} -> {t}" + ("" if w == "module" else f" ({w})")
                                                   for m, ims in imports.items() for t, w in ims
                                                   if w in kinds and package_of(m) == a and package_of(t) == b})
                            for a, b in (FOCUS, FOCUS[::-1])},
        }
        fc = result[label]["focus_cycle"]
        result[label]["focus_cycle_present"] = all(fc.values())
    return result


# ----------------------------------------------------------------------------- output

def commit_of(root: str) -> Optional[str]:
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def print_trace(fmt: str, setting: str, r: dict) -> None:
    print(f"\n== step trace: format {fmt}, compile {setting} ==")
    if "skipped" in r:
        print(f"  skipped: {r['skipped']}")
        return
    print(f"  state of one parameter: keys {r['state_keys']}, value types {r['state_types']}")
    mods = r["modules"]
    print(f"  modules entered: {len(mods)} (packages: {', '.join(short(p) for p in r['packages'])})")
    print(f"  {'module':<36} {'calls':>7}")
    for m, n in mods.items():
        print(f"  {short(m):<36} {n:>7}")
    print(f"  module -> module call edges: {len(r['edges'])}")
    print(f"  {'from':<32} {'to':<32} {'calls':>7} {'direct':>7}")
    for e in r["edges"]:
        print(f"  {short(e['from']):<32} {short(e['to']):<32} {e['calls']:>7} {e['direct']:>7}")
    trips = r["return_trips"]
    print(f"  return trips (modules calling each other): {len(trips)}"
          + "".join(f"\n    {short(a)} <-> {short(b)}" for a, b in trips))
    print(f"  call cycles (SCCs > 1 of the edges): {len(r['call_cycles'])}"
          + "".join(f"\n    {', '.join(short(m) for m in c)}" for c in r["call_cycles"]))
    print(f"  package edges: {len(r['package_edges'])}: "
          + ", ".join(f"{short(e['from'])} -> {short(e['to'])}" for e in r["package_edges"]))
    ptrips = r["package_return_trips"]
    print(f"  package return trips: {len(ptrips)}" + "".join(f"\n    {short(a)} <-> {short(b)}" for a, b in ptrips))
    print(f"  package call cycles: {len(r['package_call_cycles'])}"
          + "".join(f"\n    {', '.join(short(m) for m in c)}" for c in r["package_call_cycles"]))


def print_graph(g: dict, list_imports: bool) -> None:
    print(f"\n== static import graph: {g['modules']} modules ==")
    if list_imports:
        print(f"  {'module':<30} qstate imports ((function): inside a function; (type_checking))")
        for m, ims in g["imports"].items():
            print(f"  {short(m):<30} {', '.join(short(t) for t in ims) or '-'}")
    for label in ("all", "module_level"):
        r = g[label]
        print(f"  [{label} imports: {r['edges']} edges]")
        print(f"    module cycles (SCCs > 1): {len(r['sccs'])}"
              + "".join(f"\n      {len(c)}: {', '.join(short(m) for m in c)}" for c in r["sccs"]))
        print(f"    package cycles (SCCs > 1): {len(r['package_sccs'])}"
              + "".join(f"\n      {', '.join(short(m) for m in c)}" for c in r["package_sccs"]))
        print(f"    cycle {short(FOCUS[0])} <-> {short(FOCUS[1])}: "
              f"{'YES' if r['focus_cycle_present'] else 'no'}")
        for k, v in r["focus_cycle"].items():
            print(f"      {k}: {len(v)}" + "".join(f"\n        {e}" for e in v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="8bit", help="state_format of the AdamW (default 8bit)")
    ap.add_argument("--compile", default="default,eager",
                    help="comma list: default (the constructor's compile default), eager (compile=False)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the traced one (default 3)")
    ap.add_argument("--min-quantize-numel", type=int, default=256,
                    help="AdamW's min_quantize_numel (default 256: weights quantized, biases fp32)")
    ap.add_argument("--no-trace", action="store_true", help="only the static import graph")
    ap.add_argument("--no-import-list", action="store_true", help="leave out each module's import list")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = ap.parse_args()
    settings = [s.strip() for s in args.compile.split(",") if s.strip()]
    for s in settings:
        if s not in ("default", "eager"):
            ap.error(f"--compile: expected default and/or eager, got {s!r}")

    root = os.path.dirname(PKG_DIR)
    print(f"qstate: {qstate.__file__} (commit {commit_of(root)}), torch {torch.__version__}")
    out = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "cwd": _ROOT,
           "qstate_file": qstate.__file__, "commit": commit_of(root), "torch": torch.__version__,
           "format": args.format, "warmup": args.warmup, "min_quantize_numel": args.min_quantize_numel}
    if not args.no_trace:
        out["trace"] = run_trace(args.format, settings, args.warmup, args.min_quantize_numel)
        for s in settings:
            print_trace(args.format, s, out["trace"][s])
    out["import_graph"] = import_graph()
    print_graph(out["import_graph"], not args.no_import_list)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
