"""A warm optimizer step's calls point one way: within one ``step()``, no two qstate modules call
each other (directly, or through torch frames between them such as DTensor's dispatch).

The runtime counterpart of ``test_import_graph.py``: a base class that calls its subclass's methods
from another module, a callback handed down, or a helper module that calls back into its caller all
show as such a pair. ``benchmarks/trace_step_modules.py`` measures the same on FSDP2 with gloo ranks;
here one process steps plain tensors and, in a fake world, ``Shard(0)`` DTensors.
"""

from __future__ import annotations

import pathlib
import sys
from collections import Counter
from typing import Optional

import pytest
import torch

from qstate.optim import AdamW

from dtensor_harness import WORLD_SIZE, ensure_fake_process_group
from test_import_graph import PACKAGE, module_name


class _Calls:
    """``sys.setprofile`` hook: each call into a qstate module from the nearest qstate frame below it
    in another module, as a ``(caller, callee)`` pair."""

    def __init__(self) -> None:
        self.pairs: Counter = Counter()
        self._names: dict[str, Optional[str]] = {}

    def _module(self, code) -> Optional[str]:
        name = self._names.get(code.co_filename, "")
        if name == "":
            path = pathlib.Path(code.co_filename).resolve()
            name = module_name(path) if path.suffix == ".py" and PACKAGE in path.parents else None
            self._names[code.co_filename] = name
        return name

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        callee = self._module(frame.f_code)
        if callee is None:
            return
        back = frame.f_back
        while back is not None and back.f_code is not _STEP_CODE:
            caller = self._module(back.f_code)
            if caller is not None:
                if caller != callee:
                    self.pairs[(caller, callee)] += 1
                return
            back = back.f_back

    def step(self, opt) -> None:
        sys.setprofile(self)
        try:
            opt.step()
        finally:
            sys.setprofile(None)

    def both_ways(self) -> list[tuple[str, str]]:
        return sorted((a, b) for a, b in self.pairs if a < b and (b, a) in self.pairs)


_STEP_CODE = _Calls.step.__code__


def _shapes() -> list[tuple[int, ...]]:
    # quantized states (two weights), plain fp32 states (a bias below the size rule)
    return [(64, 256), (32, 256), (256,)]


def _warm(params, fmt: str, compile: bool) -> AdamW:
    opt = AdamW(params, lr=1e-3, state_format=fmt, compile=compile, min_quantize_numel=1024)
    for _ in range(3):
        opt.step()
    return opt


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8"])
def test_a_warm_step_of_plain_tensors_calls_one_way(fmt, compile):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in _shapes()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = _warm(params, fmt, compile)
    calls = _Calls()
    calls.step(opt)
    assert calls.pairs, "the trace saw no calls between qstate modules"
    assert calls.both_ways() == []


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_a_warm_step_of_dtensor_shards_calls_one_way(fmt):
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    ensure_fake_process_group()  # rank 0 of a fake world: the step issues no collectives
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))

    def shard(t: torch.Tensor) -> DTensor:  # rank 0's Shard(0) piece, uneven where dim 0 does not divide
        rows = -(-t.shape[0] // WORLD_SIZE)
        return DTensor.from_local(t[:rows].clone(), mesh, [Shard(0)], run_check=False, shape=t.shape,
                                  stride=t.stride())

    torch.manual_seed(0)
    params = [torch.nn.Parameter(shard(torch.randn(s))) for s in [(66, 256), (32, 256), (256,)]]
    for p in params:
        p.grad = shard(torch.randn(p.shape))
    opt = _warm(params, fmt, compile=True)
    calls = _Calls()
    calls.step(opt)
    assert ("qstate.optim._engine.step", "qstate.optim._engine.op") in calls.pairs  # through DTensor's dispatch
    assert calls.both_ways() == []
