"""docs/extending.md's examples run as a user copies them: on one process, and under FSDP2 on 2 gloo ranks
against the unsharded run (Adan, an elementwise rule in qstate's fused kernels: the same parameters bit
for bit; Adafactor with an 8bit first moment, written with torch ops: within float rounding)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import qstate
from dist_utils import run_distributed
from readme_blocks import readme_blocks

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "extending.md")
STEPS = 3


@functools.cache
def guide_namespace() -> dict:
    """Every Python block of the guide, run in order in one namespace (once per process: the guide
    registers its rule's name)."""
    namespace: dict = {"__name__": "__guide__"}
    for i, block in enumerate(readme_blocks("python", GUIDE)):
        exec(compile(block.code, f"docs/extending.md python block {i}", "exec"), namespace)
    return namespace


def test_guide_examples_run() -> None:
    ns = guide_namespace()
    assert isinstance(ns["adafactor"].state[ns["model"][0].weight]["exp_avg"], qstate.QuantizedState)
    assert {type(s).__name__ for st in ns["adan"].state.values() for s in st.values()} >= {"QuantizedState"}


def test_guide_adan_is_adan_within_8bit() -> None:
    """The guide's Adan with 8bit states against the same class with plain states (min_quantize_numel
    above every parameter): the parameters' change differs by a few percent (its norm) after 5 steps."""
    ns = guide_namespace()
    out = {}
    torch.manual_seed(0)
    start = torch.nn.Linear(256, 64).weight.detach().clone()
    for name, numel in (("8bit", 1024), ("fp32", 10**9)):
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 64)
        opt = ns["Adan"](model.parameters(), lr=1e-2, min_quantize_numel=numel)
        x = torch.randn(32, 256)
        for _ in range(5):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        out[name] = model.weight.detach().clone()
    err = (out["8bit"] - out["fp32"]).norm() / (out["fp32"] - start).norm()
    assert err < 5e-2, err


def _train(make_opt, model: torch.nn.Module, x: torch.Tensor) -> None:
    opt = make_opt(model.parameters())
    for _ in range(STEPS):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 129), torch.nn.ReLU(), torch.nn.Linear(129, 8))


OPTIMIZERS = {
    "Adan": lambda ns: (lambda ps: ns["Adan"](ps, lr=1e-2, min_quantize_numel=1024)),
    "Adafactor": lambda ns: (lambda ps: ns["Adafactor"](ps, lr=1e-2)),
}


def fsdp_body(rank: int, world_size: int, name: str) -> None:
    from torch.distributed.fsdp import fully_shard

    ns = guide_namespace()
    make_opt = OPTIMIZERS[name](ns)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    reference = _model()
    _train(make_opt, reference, x)
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    _train(make_opt, model, x)
    for (key, p), ref in zip(model.named_parameters(), reference.parameters()):
        full = p.full_tensor()
        if name == "Adan":
            assert torch.equal(full, ref), key
        else:
            torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_guide_optimizers_under_fsdp2_match_the_unsharded_run(name: str) -> None:
    run_distributed(fsdp_body, 2, name, timeout=120)
