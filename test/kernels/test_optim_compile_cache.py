"""Warm inductor caches never hand a kernel to the wrong kind or shape.

The same script runs twice in one fresh ``TORCHINDUCTOR_CACHE_DIR`` (cold,
then warm with the formats in the other order), each time with several
formats and uneven shapes (one kernel graph per format serves them all), on
plain tensors and on an FSDP2 model sharded unevenly over 2 gloo ranks (the
kernels run on the shards through ``qstate::fused_update``); both runs must
finish without errors, agree bit for bit, and match the eager path.
(Two formats keep the cold compile affordable; the in-process tests cover 4bit.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import hashlib, json, os, sys, torch
    from qstate.optim import AdamW
    from qstate.launch import run_ranks


    def digest(tensors):
        return hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors)).hexdigest()


    def fsdp_body(rank, world_size, fmt, out):
        from torch.distributed.fsdp import fully_shard
        result = {}
        for compile in (True, False):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(129, 65), torch.nn.Linear(65, 7))  # uneven rows
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            opt = AdamW(model.parameters(), lr=1e-2, state_format=fmt, min_quantize_numel=0, compile=compile)
            for step in range(2):
                model(torch.randn(4, 129, generator=torch.Generator().manual_seed(step))).square().mean().backward()
                opt.step()
                opt.zero_grad()
            result[compile] = [p.full_tensor() for p in model.parameters()]
        if rank == 0:
            diff = max(float((a - b).abs().max()) for a, b in zip(result[True], result[False]))
            with open(out, "w") as f:
                json.dump({"digest": digest(result[True]), "max_diff_vs_eager": diff}, f)


    SHAPES = [(33, 71), (1000,), (5, 3, 7), (7, 513), (64, 256)]


    def main():
        out = {}
        for fmt in sys.argv[1].split(","):
            runs = {}
            for compile in (True, False):
                g = torch.Generator().manual_seed(0)
                ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
                opt = AdamW(ps, lr=1e-2, state_format=fmt, min_quantize_numel=0, compile=compile)
                for step in range(2):
                    for p in ps:
                        p.grad = torch.randn(p.shape, generator=g)
                    opt.step()
                runs[compile] = [p.detach().clone() for p in ps]
            diff = max(float((a - b).abs().max()) for a, b in zip(runs[True], runs[False]))
            out[fmt] = {"digest": digest(runs[True]), "max_diff_vs_eager": diff}
            path = os.path.join(sys.argv[2], f"fsdp-{fmt}.json")
            run_ranks(fsdp_body, 2, fmt, path)
            with open(path) as f:
                out[f"fsdp2 {fmt}"] = json.load(f)
        print(json.dumps(out))


    if __name__ == "__main__":
        main()
    """
)


def _run(tmp: str, cache_dir: str, formats: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    env.pop("QSTATE_CPU_KERNEL_CACHE", None)  # the C kernels' cache: inside the inductor cache dir
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    script = os.path.join(tmp, "train.py")  # a file: spawned ranks import their function from it
    with open(script, "w") as f:
        f.write(SCRIPT)
    res = subprocess.run([sys.executable, script, formats, tmp], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.exhaustive  # two cold compiles in fresh interpreters
def test_two_runs_in_one_cache_dir_agree(tmp_path):
    cache = str(tmp_path / "inductor")
    first = _run(str(tmp_path), cache, "8bit,fp32")
    assert os.listdir(cache)  # the first run filled the cache
    second = _run(str(tmp_path), cache, "fp32,8bit")  # warm, kinds requested in the other order
    assert first == second
    for key, result in first.items():
        assert result["max_diff_vs_eager"] < 1e-4, (key, first)
