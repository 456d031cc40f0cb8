"""Integer ``add``/``sub`` on ``Partial`` DTensors: only the exact ``Partial`` rule stays.

torch's ``Partial`` rules of add/sub hold for real numbers. Integer add/sub wraps around mod
``2**bits``, where only the sum rule holds: wrap-around breaks ``max(a_i) + c == max(a_i + c)``,
and an integer ``avg`` truncates. With integer operands of one dtype (not ``bool``), the one rule
left is ``Partial(sum)`` for every operand; with floating or complex operands only, torch's rules
stay; with any other mix, none: integer operands of several dtypes (a pending sum of the narrower
one wraps at its own width), ``bool``, and an integer operand promoted to a floating result (the
cast of a pending integer sum does not commute with it, :mod:`._dtypes`; patch 0008 as drafted
keeps torch's rules there and lists the case as not covered). Every other ``Partial`` input is reduced first (an in-place op on such a
``Partial`` self raises, as for any rule that would change self's placement).

A ``Replicate`` operand brought to ``Partial(sum)`` is partitioned as ``v / n`` by torch, which is no
integer: for integer and ``bool`` tensors the first rank on the mesh dim keeps ``v`` and the others
hold zeros, which is exact (:func:`exact_partition`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor.placement_types import Partial, Replicate

from qstate.dtensor_rules import _compat, _probe
from qstate.dtensor_rules._registry import Rule

__all__ = ["RULES", "exact_partition", "integer_partial_rows"]

aten = torch.ops.aten


def integer_partial_rows(original: Any) -> Any:
    """torch's single-dim strategy of an additive op, with the ``Partial`` rows of integer operands
    cut to the all-``Partial(sum)`` row (one dtype, not ``bool``) or none."""

    def rows(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
        strategies = original.func(op, args_schema, kwargs_schema)
        dtypes = {a.dtype for a in args_schema if isinstance(a, TensorMeta)}
        if all(d.is_floating_point or d.is_complex for d in dtypes):
            return strategies
        exact = len(dtypes) == 1 and torch.bool not in dtypes
        return [row for row in strategies if not any(isinstance(p, Partial) for p in row)
                or (exact and all(p == Partial("sum") for p in row))]

    return dataclasses.replace(original, func=rows)


@_compat.run_per_rank
def _keep_on_first_rank(tensor: torch.Tensor, coordinate: int) -> torch.Tensor:
    return tensor if coordinate == 0 else torch.zeros_like(tensor)


def exact_partition(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``Partial._partition_value`` (``Replicate`` -> ``Partial``): an integer or ``bool`` value kept by the
    first rank on the mesh dim, zeros elsewhere, for ``sum``; torch's otherwise."""

    def _partition_value(self: Any, tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
        if self.reduce_op != "sum" or tensor.is_floating_point() or tensor.is_complex():
            return original(self, tensor, mesh, mesh_dim)
        return _keep_on_first_rank(tensor, mesh._sym_get_coordinate(mesh_dim))

    return _partition_value


@_probe.checked
def _keeps_wrapping_partial() -> bool:
    """Whether torch keeps ``Partial(max)`` through int32 ``Partial(max) + Replicate`` (wrap-around
    breaks it)."""
    ints = (_probe.spec((4,), torch.int32, [Partial("max")]), _probe.spec((4,), torch.int32, [Replicate()]))
    return _probe.keeps_partial(aten.add.Tensor, ints) or _probe.keeps_partial(aten.sub.Tensor, ints)


ADDITIVE_OPS = (aten.add.Tensor, aten.add_.Tensor, aten.add.out, aten.sub.Tensor, aten.sub_.Tensor, aten.sub.out,
                aten._foreach_add.List, aten._foreach_add_.List, aten._foreach_sub.List, aten._foreach_sub_.List)

RULES: tuple[Rule, ...] = tuple(
    Rule(op=op, form="single_dim", impl=integer_partial_rows, needed=_keeps_wrapping_partial,
         reason="add/sub with integer operands: only Partial(sum) of one dtype stays (wrap-around breaks "
                "max/min, avg truncates)")
    for op in ADDITIVE_OPS
) + (
    Rule(op="_partition_value", form="function", impl=exact_partition, needed=_keeps_wrapping_partial,
         module="torch.distributed.tensor.placement_types.Partial",
         reason="Replicate -> Partial(sum) of an integer tensor: v on the first rank, zeros elsewhere (torch "
                "divided by n)"),
)
