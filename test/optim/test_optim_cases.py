"""Helpers shared by the optimizer tests (no tests here): small models, seeded gradients, training loops."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

#: shapes with uneven rows/blocks, 1-D, 3-D and a scalar-like param
SHAPES = [(33, 71), (1000,), (5, 3, 7), (64, 256), (7, 513), (1,)]


def params(shapes: Sequence[tuple] = SHAPES, dtype=torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def grads(ps: Sequence[torch.Tensor], step: int, mixed: bool = False) -> list[torch.Tensor]:
    """Seeded gradients; ``mixed`` multiplies by 10**[-6, 2] per element (tiny and huge in one block)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for p in ps:
        x = torch.randn(p.shape, generator=g)
        if mixed:
            x = x * 10.0 ** torch.randint(-6, 3, p.shape, generator=g)
        out.append(x.to(p.dtype))
    return out


def run_steps(make_opt: Callable, ps: Sequence[torch.nn.Parameter], steps: int, mixed: bool = False,
              on_step: Callable | None = None):
    opt = make_opt(ps)
    for i in range(steps):
        for p, g in zip(ps, grads(ps, i, mixed)):
            p.grad = g
        before = [p.detach().clone() for p in ps]
        opt.step()
        if on_step is not None:
            on_step(i, before, ps, opt)
    return opt


def clone_params(ps: Sequence[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in ps]
