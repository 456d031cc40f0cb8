"""``fill_``, ``copy_`` and ``_to_copy`` on ``Partial`` DTensors.

* ``fill_``: every rank writes ``v``, so a ``Partial`` self becomes ``Replicate`` without
  communication (torch kept ``Partial(sum)``: ``world_size * v``); ``Shard``/``Replicate`` stay, and
  ``fill_.Tensor``'s 0-dim value is needed whole (``Replicate``).
* ``_to_copy`` (``.to(dtype)``): placements stay; a ``Partial`` passes only through a cast that
  commutes with its reduction (:func:`~qstate.dtensor_rules._dtypes.cast_commutes_with_reduction`),
  any other is reduced first: one all-reduce of the input.
* ``copy_(self, src)``: ``self`` keeps its layout and ``src`` is brought to it; a ``Partial`` self
  becomes ``Replicate`` holding ``src``, unless ``src`` is the same ``Partial`` and the cast from
  ``src``'s dtype commutes with the reduction (then it stays, with no communication). torch turned
  a ``Replicate`` src into ``Partial(sum)`` by dividing by the group size: wrong for integers,
  inexact for floats.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, StrategyType
from torch.distributed.tensor._ops.utils import generate_redistribute_costs
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from qstate.dtensor_rules import _probe
from qstate.dtensor_rules._dtypes import cast_commutes_with_reduction
from qstate.dtensor_rules._registry import Rule

__all__ = ["RULES", "copy_strategy", "fill_strategy", "to_copy_rows"]

aten = torch.ops.aten

#: the reductions a Partial placement may carry through a cast (torch's pass-through list)
REDUCE_OPS = ("sum", "avg", "min", "max")


def _op_spec(strategies: list[OpStrategy], inputs: list[DTensorSpec], output: DTensorSpec) -> OpSpec:
    costs = [generate_redistribute_costs(s, spec) for s, spec in zip(strategies, inputs)]
    return OpSpec(output_specs=output, input_specs=inputs, redistribute_cost=costs)


def fill_strategy(op_schema: OpSchema) -> StrategyType:
    """``fill_(self, value)``: ``Partial`` -> ``Replicate``, other placements stay; a tensor value is
    replicated."""
    self_strategy, value = op_schema.args_schema[0], op_schema.args_schema[1]
    mesh = self_strategy.mesh
    specs = []
    for arg_strategy in self_strategy.strategies:
        self_spec = arg_strategy.output_spec
        out = DTensorSpec(mesh, tuple(Replicate() if p.is_partial() else p for p in self_spec.placements))
        strategies, inputs = [self_strategy], [self_spec]
        if isinstance(value, OpStrategy):
            strategies.append(value)
            inputs.append(DTensorSpec(mesh, (Replicate(),) * mesh.ndim,
                                      tensor_meta=value.strategies[0].output_spec.tensor_meta))
        specs.append(_op_spec(strategies, inputs, out))
    return OpStrategy(specs)


def to_copy_rows(original: Any) -> Any:
    """torch's single-dim strategy of ``_to_copy`` with its ``Partial`` rows replaced by those whose
    reduction commutes with the cast."""

    def rows(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
        src = args_schema[0].dtype
        dst = kwargs_schema.get("dtype") or src
        kept = [row for row in original.func(op, args_schema, kwargs_schema)
                if not any(isinstance(p, Partial) for p in row)]
        return kept + [[Partial(r), Partial(r)] for r in REDUCE_OPS if cast_commutes_with_reduction(r, src, dst)]

    return dataclasses.replace(original, func=rows)


def _src_placement(p: Placement, offset: int, self_shape: Any, src_shape: Any) -> Placement:
    """The placement ``src`` needs on a mesh dim where ``self`` is ``Shard``-like ``p``."""
    d = p.dim - offset  # type: ignore[attr-defined]
    if d < 0 or (src_shape[d] == 1 and self_shape[p.dim] != 1):  # type: ignore[attr-defined]
        return Replicate()  # a broadcast dim: every rank needs all of src
    return Shard(d) if type(p) is Shard else type(p)(d, split_factor=p.split_factor)  # type: ignore


def copy_strategy(op_schema: OpSchema) -> StrategyType:
    """``copy_(self, src)``: see the module doc."""
    self_strategy, src_strategy = op_schema.args_schema[0], op_schema.args_schema[1]
    mesh = self_strategy.mesh
    self_spec = self_strategy.strategies[0].output_spec
    src_spec = src_strategy.strategies[0].output_spec
    self_meta, src_meta = self_spec.tensor_meta, src_spec.tensor_meta
    offset = len(self_meta.shape) - len(src_meta.shape)
    out, src_target = [], []
    for p, q in zip(self_spec.placements, src_spec.placements):
        if p.is_partial():
            keep = type(p) is Partial and q == p and cast_commutes_with_reduction(p.reduce_op, src_meta.dtype,
                                                                                   self_meta.dtype)
            out.append(p if keep else Replicate())
            src_target.append(p if keep else Replicate())
        else:
            out.append(p)
            src_target.append(p if p.is_replicate() else _src_placement(p, offset, self_meta.shape, src_meta.shape))
    target = DTensorSpec(mesh, tuple(src_target), tensor_meta=src_meta)
    return OpStrategy([_op_spec([self_strategy, src_strategy], [self_spec, target], DTensorSpec(mesh, tuple(out)))])


def _partial(dtype: torch.dtype, reduce_op: str = "sum") -> Any:
    return _probe.spec((4,), dtype, [Partial(reduce_op)])


@_probe.checked
def _fill_keeps_partial() -> bool:
    return _probe.keeps_partial(aten.fill_.Scalar, (_partial(torch.float32), 1.0))


@_probe.checked
def _to_copy_keeps_partial_through_narrowing() -> bool:
    """Whether torch keeps ``Partial(max)`` through int32 -> uint8 or ``Partial(sum)`` through float32 ->
    bfloat16 (neither commutes)."""
    return (_probe.keeps_partial(aten._to_copy.default, (_partial(torch.int32, "max"),), {"dtype": torch.uint8})
            or _probe.keeps_partial(aten._to_copy.default, (_partial(torch.float32),), {"dtype": torch.bfloat16}))


@_probe.checked
def _copy_divides_replicate_src() -> bool:
    """Whether torch's ``copy_`` into ``Partial(sum)`` int32 from a ``Replicate`` src keeps ``Partial``
    (it divides src by the group size) or keeps ``Partial(max)`` through a narrowing cast."""
    replicate = _probe.spec((4,), torch.int32, [Replicate()])
    return (_probe.keeps_partial(aten.copy_.default, (_partial(torch.int32), replicate))
            or _probe.keeps_partial(aten.copy_.default, (_partial(torch.uint8, "max"), _partial(torch.int32, "max"))))


RULES: tuple[Rule, ...] = (
    *(Rule(op=op, form="strategy", impl=fill_strategy, needed=_fill_keeps_partial,
           reason="fill_ on Partial: Replicate without communication (torch kept Partial: n x value)")
      for op in (aten.fill_.Scalar, aten.fill_.Tensor)),
    Rule(op=aten._to_copy.default, form="single_dim", impl=to_copy_rows,
         needed=_to_copy_keeps_partial_through_narrowing,
         reason="_to_copy: Partial only through casts that commute with its reduction, else reduced first"),
    Rule(op=aten.copy_.default, form="strategy", impl=copy_strategy, needed=_copy_divides_replicate_src,
         reason="copy_ into Partial: Replicate holding src, or the same Partial through a cast that commutes"),
)
