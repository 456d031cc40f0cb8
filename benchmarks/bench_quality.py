"""Training quality of quantized optimizer states: final loss of each format against fp32 AdamW.

A suite of small tasks that run on a CPU in minutes, unlike the test suite's own case:

* ``digits-*``: MLPs (GELU) of several widths and depths on scikit-learn's bundled
  digits (no download), batch 64 or 128, 200 .. 500 steps; metric: training loss
  over the whole data set at the end;
* ``bytes-tf``: a byte-level causal transformer (4 layers, d_model 128, 4 heads,
  context 64, batch 16, 300 steps) on a text file present on the machine (the
  licenses in ``/usr/share/common-licenses``, else Python's own ``LICENSE.txt``
  or standard library sources), 90/10 split; metric: held-out loss (nats/byte);
* ``digits-cnn``: a convolutional net (two 3x3 convolutions, 32 and 64
  channels, pooling, a linear head) on the 8x8 digit images, 300 steps.

Every candidate is AdamW with ``lr=1e-3`` (weight decay 0.01) and the same
initialization and batches per seed: ``fp32`` is ``torch.optim.AdamW``; ``qstate
<fmt>`` is ``qstate.optim.AdamW(state_format=fmt, min_quantize_numel=1024)``
(defaults otherwise: compiled kernels, the format's default rounding);
``torchao AdamW4bit``/``AdamW8bit`` join when ``torchao.optim`` imports
(its own defaults: block 128/256, states for tensors of 4096+ elements).
A candidate's figure is ``final loss / fp32's final loss - 1`` per seed; the
table gives the worst and the mean over seeds, and the targets are checked on
the worst (4bit within 5%, 8bit and fp8 within 2%, 4bit no worse than
torchao's AdamW4bit). A bar plot goes to ``quality.png`` where matplotlib
imports; the table is always printed and the results saved as JSON.

    python benchmarks/bench_quality.py [--quick] [--tasks a,b] [--seeds 0,1,2] [--out DIR]
    python benchmarks/bench_quality.py --sensitivity

``--sensitivity``: how much float-order noise in the gradients moves the
parameters. The digits MLP 64-256-128-10 trained for 5 steps (batch 64)
unsharded in one process, and under FSDP2 on 2 gloo ranks, each rank taking
half of every batch (the gradients then differ from the unsharded ones in
float order only); the table gives the largest parameter difference between
the two runs per optimizer and state format / rounding, op by op
(``compile=False``) and, for the default rounding, with the fused kernels.

``--quick``: two tasks, shortened (about a minute on one core); the full suite
gives the recorded results (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from _common import RESULTS_DIR, environment, parse_list, save_json, target_line, try_import

import qstate.optim as qoptim

LR = 1e-3
WEIGHT_DECAY = 0.01
MIN_QUANTIZE_NUMEL = 1024


# ---------------------------------------------------------------------------- data
_DIGITS = None


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    global _DIGITS
    if _DIGITS is None:
        from sklearn.datasets import load_digits

        d = load_digits()
        _DIGITS = torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target, dtype=torch.long)
    return _DIGITS


def text_bytes() -> tuple[torch.Tensor, str]:
    """The bytes of a text file present on the machine (and where they came from)."""
    files = sorted(f for f in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(f))
    where = "/usr/share/common-licenses/*"
    if not files:
        lic = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}",
                           "LICENSE.txt")
        files = [lic] if os.path.isfile(lic) else sorted(glob.glob(os.path.join(os.path.dirname(os.__file__),
                                                                                  "[a-f]*.py")))[:20]
        where = files[0] if len(files) == 1 else os.path.dirname(os.__file__) + "/[a-f]*.py"
    seen, data = set(), b""
    for f in files:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            with open(real, "rb") as fh:
                data += fh.read()
    return torch.tensor(list(data), dtype=torch.long), where


# ---------------------------------------------------------------------------- models
def mlp(widths: tuple[int, ...]) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    dims = [64, *widths]
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    layers.append(torch.nn.Linear(dims[-1], 10))
    return torch.nn.Sequential(*layers)


class _Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ByteTransformer(torch.nn.Module):
    def __init__(self, d: int = 128, layers: int = 4, heads: int = 4, context: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(256, d)
        self.pos = torch.nn.Parameter(torch.randn(context, d) * 0.02)
        self.blocks = torch.nn.Sequential(*[_Block(d, heads) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.emb(idx) + self.pos[: idx.shape[1]])))


class DigitsCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.GELU(),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.GELU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(64 * 16, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.view(-1, 1, 8, 8))


# ---------------------------------------------------------------------------- tasks
@dataclass
class Task:
    name: str
    kind: str  # "digits" (model on digits), "text" (byte transformer)
    make_model: Callable[[], torch.nn.Module]
    steps: int
    batch: int
    what: str


def tasks(quick: bool) -> list[Task]:
    if quick:
        return [Task("digits-256-128", "digits", lambda: mlp((256, 128)), 100, 64, "MLP 64-256-128-10, batch 64"),
                Task("bytes-tf-2x64", "text", lambda: ByteTransformer(64, 2, 4, 32), 60, 16,
                     "byte transformer, 2 layers, d_model 64, context 32")]
    return [
        Task("digits-256-128", "digits", lambda: mlp((256, 128)), 300, 64, "MLP 64-256-128-10, batch 64"),
        Task("digits-512", "digits", lambda: mlp((512,)), 500, 64, "MLP 64-512-10, batch 64"),
        Task("digits-128-64", "digits", lambda: mlp((128, 64)), 300, 64, "MLP 64-128-64-10, batch 64"),
        Task("digits-3x192", "digits", lambda: mlp((192, 192, 192)), 200, 128, "MLP 64-192-192-192-10, batch 128"),
        Task("bytes-tf", "text", lambda: ByteTransformer(), 300, 16,
             "byte transformer, 4 layers, d_model 128, context 64"),
        Task("digits-cnn", "digits", DigitsCNN, 300, 64, "conv 32-64, pool, MLP head, batch 64"),
    ]


def held_out_tasks() -> list[Task]:
    """Digits MLPs of widths the suite does not have, run only when named in ``--tasks`` (``held-out``: all of
    them): a check that a change tuned on the suite did not fit it."""
    return [Task("digits-192", "digits", lambda: mlp((192,)), 300, 64, "MLP 64-192-10, batch 64"),
            Task("digits-384-192", "digits", lambda: mlp((384, 192)), 300, 64, "MLP 64-384-192-10, batch 64"),
            Task("digits-512-256", "digits", lambda: mlp((512, 256)), 300, 64, "MLP 64-512-256-10, batch 64")]


def train(task: Task, make_opt: Callable, seed: int) -> float:
    """Final loss of ``task`` trained from seed ``seed`` with ``make_opt(params)``."""
    torch.manual_seed(seed)
    model = task.make_model()
    opt = make_opt(model.parameters())
    gen = torch.Generator().manual_seed(seed)
    ce = torch.nn.functional.cross_entropy
    if task.kind == "digits":
        x, y = digits()
        for _ in range(task.steps):
            idx = torch.randint(0, x.shape[0], (task.batch,), generator=gen)
            loss = ce(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            return float(ce(model(x), y))
    data, _ = text_bytes()
    split = int(0.9 * len(data))
    train_bytes, held_out = data[:split], data[split:]
    context = model.pos.shape[0]

    def batch(src, g, n):
        ix = torch.randint(0, len(src) - context - 1, (n,), generator=g)
        return (torch.stack([src[i:i + context] for i in ix]), torch.stack([src[i + 1:i + context + 1] for i in ix]))

    for _ in range(task.steps):
        xb, yb = batch(train_bytes, gen, task.batch)
        loss = ce(model(xb).flatten(0, 1), yb.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    eval_gen = torch.Generator().manual_seed(1234)  # the same held-out batches for every candidate
    with torch.no_grad():
        losses = [float(ce(model(xb).flatten(0, 1), yb.flatten()))
                  for xb, yb in (batch(held_out, eval_gen, 32) for _ in range(8))]
    return sum(losses) / len(losses)


# ---------------------------------------------------------------------------- candidates
def candidates(formats: list[str]) -> tuple[dict[str, Callable], list[str]]:
    makers: dict[str, Callable] = {"fp32": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY)}
    for fmt in formats:
        makers[f"qstate {fmt}"] = (lambda f: lambda ps: qoptim.AdamW(
            ps, lr=LR, weight_decay=WEIGHT_DECAY, state_format=f, min_quantize_numel=MIN_QUANTIZE_NUMEL,
            seed=0))(fmt)  # one rounding stream per run: the figures repeat
    notes = []
    for cls in ("AdamW4bit", "AdamW8bit"):
        ao, why = try_import("torchao.optim", cls)
        if ao is None:
            notes.append(f"skipped torchao {cls}: {why}")
        else:
            makers[f"torchao {cls}"] = (lambda c: lambda ps: c(ps, lr=LR, weight_decay=WEIGHT_DECAY))(ao)
    return makers, notes


# ---------------------------------------------------------------------------- float-order sensitivity
SENSITIVITY_STEPS = 5
#: (optimizer, state format, state_rounding, compile): op by op, and the fused kernels for the default rounding
SENSITIVITY_CASES = [("AdamW", "fp32", None, False), ("AdamW", "8bit", None, False), ("AdamW", "fp8", None, False),
                     ("AdamW", "4bit", "nearest", False), ("AdamW", "4bit", None, False),
                     ("AdamW", "4bit", None, True), ("Lion", "4bit", "nearest", False), ("Lion", "4bit", None, False),
                     ("Lion", "4bit", None, True), ("SGD", "4bit", "nearest", False), ("SGD", "4bit", None, False)]


def _sensitivity_opt(params, optimizer: str, fmt: str, rounding: Optional[str], compile: bool):
    # seed: the unsharded and the sharded run round with one stream
    kw = dict(state_format=fmt, state_rounding=rounding, min_quantize_numel=MIN_QUANTIZE_NUMEL, compile=compile,
              seed=0)
    if optimizer == "AdamW":
        return qoptim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **kw)
    if optimizer == "Lion":
        return qoptim.Lion(params, lr=3e-4, weight_decay=0.1, **kw)
    return qoptim.SGD(params, lr=0.05, momentum=0.9, **kw)


def _sensitivity_run(seed: int, optimizer: str, fmt: str, rounding: Optional[str], compile: bool, rank: int = 0,
                     world: int = 1) -> list[torch.Tensor]:
    """Parameters after the steps, the model FSDP2-sharded over ``world`` ranks when ``world > 1``
    (each rank takes its share of every batch); full tensors on every rank."""
    torch.manual_seed(seed)
    model = mlp((256, 128))
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = _sensitivity_opt(model.parameters(), optimizer, fmt, rounding, compile)
    x, y = digits()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(SENSITIVITY_STEPS):
        idx = torch.randint(0, x.shape[0], (64,), generator=gen).chunk(world)[rank]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _sensitivity_rank(rank: int, world: int, seed: int, out: str) -> None:
    torch.set_num_threads(1)
    got = {case: _sensitivity_run(seed, *case, rank, world) for case in SENSITIVITY_CASES}
    if rank == 0:
        torch.save(got, out)


def sensitivity(seeds: list[int]) -> list[str]:
    """Largest |parameter difference| between the unsharded run and FSDP2 on 2 ranks, per case and seed."""
    import tempfile

    from qstate.launch import run_ranks

    rows = []
    for opt_name, fmt, rounding, compile in SENSITIVITY_CASES:
        rows.append([f"{opt_name} {fmt} {rounding or 'default'}{' (fused)' if compile else ''}"])
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "sharded.pt")
            run_ranks(_sensitivity_rank, 2, seed, out)
            sharded = torch.load(out)
        for row, case in zip(rows, SENSITIVITY_CASES):
            whole = _sensitivity_run(seed, *case)
            row.append(max(float((a - b).abs().max()) for a, b in zip(whole, sharded[case])))
    lines = [f"{'optimizer, state, rounding':36s} " + " ".join(f"{'seed ' + str(s):>9s}" for s in seeds)]
    lines += [f"{row[0]:36s} " + " ".join(f"{v:9.2e}" for v in row[1:]) for row in rows]
    return lines


# ---------------------------------------------------------------------------- report
def table(results: dict, names: list[str], task_list: list[Task]) -> list[str]:
    """Rows: tasks; columns: fp32's mean final loss, then each candidate's worst / mean gap over seeds (%)."""
    others = [n for n in names if n != "fp32"]
    head = f"{'task':16s} {'fp32 loss':>9s} " + " ".join(f"{n:>19s}" for n in others)
    lines = [head, f"{'':16s} {'':>9s} " + " ".join(f"{'worst / mean %':>19s}" for _ in others)]
    for t in task_list:
        r = results[t.name]
        ref = r["fp32"]
        row = f"{t.name:16s} {sum(ref) / len(ref):9.4f} "
        for n in others:
            gaps = [100 * (a / b - 1) for a, b in zip(r[n], ref)]
            row += f"{max(gaps):+9.1f} / {sum(gaps) / len(gaps):+6.1f}  "
        lines.append(row.rstrip())
    return lines


def worst_gap(results: dict, name: str) -> Optional[float]:
    gaps = [max(a / b - 1 for a, b in zip(r[name], r["fp32"])) for r in results.values() if name in r]
    return max(gaps) if gaps else None


def plot(results: dict, names: list[str], task_list: list[Task], path: str, title: str) -> Optional[str]:
    plt, why = try_import("matplotlib.pyplot")
    if plt is None:
        print(f"no plot: {why}")
        return None
    others = [n for n in names if n != "fp32"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(task_list), 4))
    width = 0.8 / max(1, len(others))
    for i, n in enumerate(others):
        worst = [max(100 * (a / b - 1) for a, b in zip(results[t.name][n], results[t.name]["fp32"]))
                 for t in task_list]
        ax.bar([j + i * width for j in range(len(task_list))], worst, width, label=n)
    ax.axhline(5, color="k", lw=0.8, ls="--")
    ax.axhline(2, color="k", lw=0.8, ls=":")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(task_list))], [t.name for t in task_list], fontsize=8)
    ax.set_ylabel("final loss vs fp32 AdamW, worst seed (%)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"saved {path}")
    return path


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shortened tasks, seed 0")
    ap.add_argument("--tasks", default="", help="comma-separated task names (default: all of the suite; "
                    "'held-out': digits MLPs of other widths)")
    ap.add_argument("--seeds", default="", help="comma-separated seeds (default: 0,1,2; --quick: 0)")
    ap.add_argument("--formats", default="4bit,8bit,fp8", help="qstate state formats")
    ap.add_argument("--candidates", default="", help="only these candidates (fp32 always runs)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sensitivity", action="store_true",
                    help="float-order sensitivity: unsharded vs FSDP2 on 2 ranks, 5 steps")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.sensitivity:
        seeds = [int(s) for s in parse_list(args.seeds)] if args.seeds else [0, 1, 2]
        print(f"bench_quality --sensitivity: {environment()}\nmax |parameter difference|, unsharded vs FSDP2 on "
              f"2 ranks (half of each batch per rank), digits MLP 64-256-128-10, {SENSITIVITY_STEPS} steps")
        print("\n".join(sensitivity(seeds)))
        return
    task_list = tasks(args.quick)
    if args.tasks:
        want = parse_list(args.tasks)
        if "held-out" in want:
            want = [w for w in want if w != "held-out"] + [t.name for t in held_out_tasks()]
        task_list += [t for t in held_out_tasks() if t.name in want]
        unknown = set(want) - {t.name for t in task_list}
        if unknown:
            raise SystemExit(f"unknown tasks {sorted(unknown)}; the suite has {[t.name for t in task_list]}")
        task_list = [t for t in task_list if t.name in want]
    seeds = [int(s) for s in parse_list(args.seeds)] if args.seeds else ([0] if args.quick else [0, 1, 2])
    makers, notes = candidates(parse_list(args.formats))
    if args.candidates:
        keep = set(parse_list(args.candidates)) | {"fp32"}
        makers = {k: v for k, v in makers.items() if k in keep}
    names = list(makers)
    env = environment()
    _, text_from = text_bytes()
    print(f"bench_quality: {env}\ntext: {text_from}; seeds {seeds}; lr {LR}, weight decay {WEIGHT_DECAY}, "
          f"min_quantize_numel {MIN_QUANTIZE_NUMEL}")
    for n in notes:
        print(n)
    results: dict[str, dict[str, list[float]]] = {}
    t0 = time.perf_counter()
    for t in task_list:
        results[t.name] = {n: [] for n in names}
        for seed in seeds:
            for n in names:
                results[t.name][n].append(train(t, makers[n], seed))
            print(f"  {t.name} seed {seed}: " + ", ".join(f"{n} {results[t.name][n][-1]:.4f}" for n in names)
                  + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    lines = table(results, names, task_list)
    print("\n".join(lines))
    print()
    for fmt, limit in (("4bit", 0.05), ("8bit", 0.02), ("fp8", 0.02)):
        if f"qstate {fmt}" in names:
            print(target_line(f"target: qstate {fmt} worst final loss over fp32 - 1", worst_gap(results, f"qstate {fmt}"),
                              limit))
    if "qstate 4bit" in names and "torchao AdamW4bit" in names:
        behind = [t.name for t in task_list
                  if max(a / b for a, b in zip(results[t.name]["qstate 4bit"], results[t.name]["fp32"]))
                  > max(a / b for a, b in zip(results[t.name]["torchao AdamW4bit"], results[t.name]["fp32"]))]
        print(f"target: qstate 4bit no worse than torchao AdamW4bit (worst seed) on every task: "
              f"{'met' if not behind else 'NOT met on ' + ', '.join(behind)}")
    title = f"torch {env['torch']}, {env['cpu']}, {env['date']}, seeds {seeds}"
    suffix = "_quick" if args.quick else ""
    plot(results, names, task_list, os.path.join(args.out, f"quality{suffix}.png"), title)
    save_json({"env": env, "text": text_from, "seeds": seeds, "tasks": {t.name: t.what for t in task_list},
               "steps": {t.name: t.steps for t in task_list}, "results": results, "table": lines},
              args.out, f"quality{suffix}.json")


if __name__ == "__main__":
    main()
