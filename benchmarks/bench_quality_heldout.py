"""Training quality on held-out tasks: bench_quality's method on models nobody tuned the formats for.

``bench_quality.py``'s suite is the one the state formats were developed against; these tasks
check that its figures carry over. Digits MLPs (GELU) of widths that suite does not use:

* ``digits-192``: 64-192-10, batch 64, 300 steps;
* ``digits-384-192``: 64-384-192-10, batch 64, 300 steps.

Everything else is ``bench_quality``'s: AdamW ``lr=1e-3``, weight decay 0.01, the same
initialization and batches per seed for every candidate, ``min_quantize_numel=1024``, metric the
training loss over the whole data set at the end, a candidate's figure ``final loss / fp32's
final loss - 1`` per seed (table: worst and mean over seeds; targets checked on the worst:
4bit within 5%, 8bit and fp8 within 2%).

    python benchmarks/bench_quality_heldout.py [--seeds 0,1,2] [--formats 4bit,8bit,fp8] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import torch

from _common import RESULTS_DIR, environment, parse_list, save_json, target_line
from bench_quality import LR, MIN_QUANTIZE_NUMEL, WEIGHT_DECAY, Task, candidates, mlp, table, train, worst_gap

HELD_OUT_TASKS = [
    Task("digits-192", "digits", lambda: mlp((192,)), 300, 64, "MLP 64-192-10, batch 64"),
    Task("digits-384-192", "digits", lambda: mlp((384, 192)), 300, 64, "MLP 64-384-192-10, batch 64"),
]


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--formats", default="4bit,8bit,fp8", help="qstate state formats")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in parse_list(args.seeds)]
    makers, notes = candidates(parse_list(args.formats))
    names = list(makers)
    env = environment()
    print(f"bench_quality_heldout: {env}\nseeds {seeds}; lr {LR}, weight decay {WEIGHT_DECAY}, "
          f"min_quantize_numel {MIN_QUANTIZE_NUMEL}")
    for n in notes:
        print(n)
    results: dict[str, dict[str, list[float]]] = {}
    t0 = time.perf_counter()
    for t in HELD_OUT_TASKS:
        results[t.name] = {n: [] for n in names}
        for seed in seeds:
            for n in names:
                results[t.name][n].append(train(t, makers[n], seed))
            print(f"  {t.name} seed {seed}: " + ", ".join(f"{n} {results[t.name][n][-1]:.4f}" for n in names)
                  + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    lines = table(results, names, HELD_OUT_TASKS)
    print("\n".join(lines))
    print()
    for fmt, limit in (("4bit", 0.05), ("8bit", 0.02), ("fp8", 0.02)):
        if f"qstate {fmt}" in names:
            print(target_line(f"target: qstate {fmt} worst final loss over fp32 - 1", worst_gap(results, f"qstate {fmt}"),
                              limit))
    save_json({"env": env, "seeds": seeds, "tasks": {t.name: t.what for t in HELD_OUT_TASKS},
               "steps": {t.name: t.steps for t in HELD_OUT_TASKS}, "results": results, "table": lines},
              args.out, "quality_heldout.json")


if __name__ == "__main__":
    main()
