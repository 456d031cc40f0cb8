"""``add``/``sub`` with an integer operand on ``Partial`` DTensors.

torch's rules keep ``Partial`` through ``a + b``: ``Partial(sum) + Replicate`` divides the replicated
operand by the group size (not integral: ``int + int`` came back float32) and ``Partial(max) + c``
assumes ``max(a_i) + c == max(a_i + c)``, which wrap-around breaks. Where an operand is not floating,
the ``Partial`` rows are dropped, so a ``Partial`` input is reduced first (and an in-place
``Partial`` self raises, as torch does for in-place ops that need a placement change).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor.placement_types import Partial, Replicate

from qstate.dtensor_rules import _probe
from qstate.dtensor_rules._registry import Rule

__all__ = ["RULES", "floating_partial_rows"]

aten = torch.ops.aten


def floating_partial_rows(original: Any) -> Any:
    """torch's single-dim strategy of an additive op, without its ``Partial`` rows unless every tensor
    operand is floating (or complex)."""

    def rows(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
        strategies = original.func(op, args_schema, kwargs_schema)
        if all(a.dtype.is_floating_point or a.dtype.is_complex for a in args_schema if isinstance(a, TensorMeta)):
            return strategies
        return [s for s in strategies if not any(isinstance(p, Partial) for p in s)]

    return dataclasses.replace(original, func=rows)


@_probe.checked
def _keeps_integer_partial() -> bool:
    """Whether torch keeps ``Partial(sum)`` through int32 ``Partial(sum) + Replicate``."""
    ints = (_probe.spec((4,), torch.int32, [Partial()]), _probe.spec((4,), torch.int32, [Replicate()]))
    return _probe.keeps_partial(aten.add.Tensor, ints) or _probe.keeps_partial(aten.sub.Tensor, ints)


RULES: tuple[Rule, ...] = tuple(
    Rule(op=op, form="single_dim", impl=floating_partial_rows, needed=_keeps_integer_partial,
         reason="add/sub with an integer operand: a Partial input is reduced first (torch divided a "
                "Replicate operand by n, and wrap-around breaks max/min)")
    for op in (aten.add.Tensor, aten.add_.Tensor, aten.add.out, aten.sub.Tensor, aten.sub_.Tensor, aten.sub.out)
)
