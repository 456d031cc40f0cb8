"""Warm inductor caches never hand a kernel to the wrong kind or shape.

The same script runs twice in one fresh ``TORCHINDUCTOR_CACHE_DIR`` (cold,
then warm with the formats in the other order), each time with several
formats and uneven shapes (one kernel graph per format serves them all); both
runs must finish without errors, agree bit for bit, and match the eager path.
(Two formats keep the cold compile affordable; the in-process tests cover 4bit.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys, torch
    from qstate.optim import AdamW

    SHAPES = [(33, 71), (1000,), (5, 3, 7), (7, 513), (64, 256)]
    out = {}
    for fmt in sys.argv[1].split(","):
        for compile in (True, False):
            g = torch.Generator().manual_seed(0)
            ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
            opt = AdamW(ps, lr=1e-2, state_format=fmt, min_quantize_numel=0, compile=compile)
            for step in range(2):
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
            out[f"{fmt}-{compile}"] = [p.detach().clone() for p in ps]
        diff = max(float((a - b).abs().max()) for a, b in zip(out[f"{fmt}-True"], out[f"{fmt}-False"]))
        digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in out[f"{fmt}-True"])).hexdigest()
        out[fmt] = {"digest": digest, "max_diff_vs_eager": diff}
    print(json.dumps({k: v for k, v in out.items() if isinstance(v, dict)}))
    """
)


def _run(cache_dir: str, formats: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SCRIPT, formats], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_two_runs_in_one_cache_dir_agree(tmp_path):
    cache = str(tmp_path / "inductor")
    first = _run(cache, "8bit,fp32")
    assert os.listdir(cache)  # the first run filled the cache
    second = _run(cache, "fp32,8bit")  # warm, kinds requested in the other order
    assert first == second
    for fmt in ("8bit", "fp32"):
        assert first[fmt]["max_diff_vs_eager"] < 1e-4, first
